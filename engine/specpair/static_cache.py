"""Moved: the cache and its steps live in the package specpair.kv, one concern a module (see its
__init__). This module only re-exports the names three files still import from here while their
owners change them (drafters.py, being made a package; paged_cache.py; decoding.py); it goes
once they import from specpair.kv. Patch a name where it lives (specpair.kv.<module>), never
here: a patch of this module's copy changes nothing the engine calls."""

from specpair.kv.buckets import bucket  # noqa: F401
from specpair.kv.choice import (check_static_step, kv_model, resolve_kv_kind,  # noqa: F401
                                 step_description)
from specpair.kv.compiling import compiled_function, resolve_compile  # noqa: F401
from specpair.kv.families import supports  # noqa: F401
from specpair.kv.fixed_step import fixed_step_applies  # noqa: F401
from specpair.kv.graphs import StepGraphs, cuda_graphs_wanted, to_device  # noqa: F401
from specpair.kv.runner import StaticLlama  # noqa: F401
from specpair.kv.static import StaticKVModel  # noqa: F401
