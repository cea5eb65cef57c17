"""Every integration test starts from unpatched transformers classes and modelling modules.

``onca.apply`` patches RoPE's module-level function for the whole family (the attention layers look
it up there), and ``apply_to`` patches classes: a test that leaves either in place would silently
route another test's plain Hugging Face reference through Onca. This fixture undoes every
process-wide patch after each test, whatever the test did.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _restore_process_wide_patches():
    yield
    try:
        from onca.integrations.transformers import patch
    except ImportError:  # no transformers: nothing was patched
        return
    for (owner, name), original in list(patch._ORIGINALS.items()):
        setattr(owner, name, original)
    patch._ORIGINALS.clear()
    patch._GLOBAL_USERS.clear()
