"""Graph-to-graph passes run before lowering (see ``post_grad_passes`` for the order)."""
from .collectives import sink_waits
from .graph_passes import (constant_fold, cse, dead_code_elimination, joint_graph_passes, post_grad_passes,
                           pre_grad_passes, remove_noops, view_to_reshape)
from .library_calls import library_call_passes
from .patterns import apply_pattern_rewrites
from .symbolic import known_true, statically_equal

__all__ = ["constant_fold", "cse", "dead_code_elimination", "joint_graph_passes", "post_grad_passes",
           "pre_grad_passes", "remove_noops", "view_to_reshape", "apply_pattern_rewrites",
           "known_true", "statically_equal", "library_call_passes", "sink_waits"]
