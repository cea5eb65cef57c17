"""Integrations with model libraries: Hugging Face transformers (``onca.apply``) and the ``kernels``
package's ``kernelize`` (``onca.integrations.kernels``)."""
