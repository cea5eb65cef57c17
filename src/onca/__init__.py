"""Onca: fast, memory-lean Triton kernels for training large language models."""

from onca import device as _device

# Must run before any kernel module is imported: Triton decides interpreter vs compiler when a
# kernel is decorated.
_device.ensure_interpreter()

from onca import functional, nn  # noqa: E402
from onca.device import get_profile  # noqa: E402
from onca.ops._small_calls import limit as small_call_limit  # noqa: E402
from onca.ops._small_calls import set_limit as set_small_call_limit  # noqa: E402

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("onca")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "functional", "nn", "get_profile", "small_call_limit", "set_small_call_limit",
    "apply", "apply_to", "unapply", "unapply_to",
    "AutoModelForCausalLM", "supported_model_types", "__version__",
]

_INTEGRATION = ("apply", "apply_to", "unapply", "unapply_to", "AutoModelForCausalLM", "supported_model_types")


def __getattr__(name):
    # The transformers integration is imported on first use: `import onca` needs no transformers.
    if name in _INTEGRATION:
        from onca.integrations import transformers as integration

        return getattr(integration, name)
    raise AttributeError(f"module 'onca' has no attribute {name!r}")
