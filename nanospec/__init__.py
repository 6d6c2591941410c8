"""nanospec: a nano LLM inference engine built around Frozen-KV MTP speculative decoding."""

import importlib.util
import sys
from pathlib import Path

# The Triton kernels live in the top-level kernels/ folder, which has no __init__.py: from the repo root
# (sys.path[0] for `python example.py`) it must never be the top-level package `kernels`, a name that belongs
# to PyPI's `kernels`, which transformers imports. It is only ever the subpackage nanospec.kernels: an
# installed wheel carries it as nanospec/kernels/; a source checkout (editable install, or the repo root)
# registers the folder under that name here (DESIGN §1).
_here = Path(__file__).resolve().parent
if not (_here / "kernels").is_dir():
    _spec = importlib.util.spec_from_loader(__name__ + ".kernels", None, is_package=True)
    _spec.submodule_search_locations = [str(_here.parent / "kernels")]
    kernels = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)

from .llm import LLM  # noqa: E402
from .sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams"]
