"""The suite runs on machines without a GPU (CI), where the generated Triton kernels run in
Triton's interpreter. The interpreter must be on before ``triton.language`` is first imported
(Triton decides per ``@triton.jit`` function, at definition), and test modules of any folder
may import it during collection (through torch, aotforge or Triton itself), so it is switched
on here, before anything is collected. On a GPU machine (tests/gpu) it stays off."""
import atexit
import os
import shutil
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests compile to see the compiler work: the compiled-graph and AOT caches would replace that
# with a load from an earlier run. Their own tests (tests/compiler/runtime/test_graph_cache.py)
# turn them on.
os.environ.setdefault("AOTFORGE_CACHE", "0")
# ... but a C++ translation unit that many tests generate alike (the same small graph, the same
# kernels) is given to the compiler once per session: the libraries alone are kept in a folder
# of this session, keyed and verified as the cache keeps them (source, compiler command and
# version, CPU; config.library_cache_dir). Every test still traces, lowers and generates its
# graphs, and a source no test compiled before still goes to the compiler; subprocesses the tests
# start share the folder. The cache's own tests turn it off (tests/compiler/runtime). Set
# AOTFORGE_LIBRARY_CACHE_DIR= (empty) to compile every library in every test.
if "AOTFORGE_LIBRARY_CACHE_DIR" not in os.environ:
    os.environ["AOTFORGE_LIBRARY_CACHE_DIR"] = tempfile.mkdtemp(prefix="aotforge_test_libraries_")
    atexit.register(shutil.rmtree, os.environ["AOTFORGE_LIBRARY_CACHE_DIR"], True)
# A compiler failure raises in tests (users get eager's kernels and a warning instead), so that
# no bug hides behind the fallback.
os.environ.setdefault("AOTFORGE_STRICT", "1")
# CPU convolutions take the layout rule, not a timing that other work on the machine can sway:
# tests that check a graph's layouts see the same graph every run (the timing's own tests,
# tests/compiler/passes/test_convolution_timing.py, turn it on).
os.environ.setdefault("AOTFORGE_CPU_CONVOLUTION_TIMING", "0")


# `python -m pytest -m quick`: a representative subset (about 1-2 min on a CPU), one slice of
# every pipeline stage plus the tests that new torch releases broke before (fake tensors,
# functionalization's view replay, export). CI runs it against the newest and the oldest torch
# our range admits (.ci/run). Listed here by test id prefix, so that the test files stay as they are.
QUICK = (
    "tests/test_torch_versions.py",
    "tests/test_packaging.py::test_installed_torch_is_in_the_supported_range",
    # aot: eager's contract (values, gradients, mutations, views and their grad_fn kinds)
    "tests/aot/test_foundation.py::test_matches_eager",
    "tests/aot/test_foundation.py::test_torch_compile_aotforge_eager_training_step",
    "tests/aot/test_eager_contract_runtime.py::test_multi_output_views",
    "tests/aot/test_mutation_aliasing.py::test_case[",
    "tests/aot/test_mutation_aliasing.py::test_storage_swaps_on_inputs_are_clear_errors",
    "tests/aot/test_subclasses.py::test_two_tensor_metadata_mutation_is_rejected_like_pytorch",
    "tests/aot/test_export.py::test_batchnorm_signature_matches_torch",
    "tests/aot/test_export_guards.py::test_values_read_from_tensors_need_dynamic_shapes_and_torch_check",
    "tests/aot/test_rng.py::test_matches_eager_on_cpu",
    "tests/aot/test_mutation_aliasing.py::test_multi_output_views_reject_inplace_like_eager",
    # entry points leave torch as they found it: eager torch.cond afterwards (issue 36)
    "tests/aot/test_leaves_torch_as_found.py",
    # a cold and a warm compile with the caches on raise no torch deprecation (-W error)
    "tests/test_no_deprecation_warnings.py",
    # partition and compiler
    "tests/partition/test_mincut.py::test_gradients_equal_eager",
    "tests/compiler/test_pipeline.py::test_write_back_into_a_view_of_an_input",
    "tests/compiler/test_dynamic.py::test_sizes_not_multiple_of_block",
    "tests/test_backends.py::test_cpu_graphs_run_undecomposed_and_the_log_says_why",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(QUICK):
            item.add_marker(pytest.mark.quick)


def pytest_ignore_collect(collection_path, config):
    """Under `-m quick` alone, skip importing the other test files (collecting the whole suite
    takes longer than running the subset)."""
    if config.getoption("markexpr", "") != "quick" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    path = collection_path.resolve().relative_to(config.rootpath.resolve()).as_posix()
    return True if path not in {prefix.split("::")[0] for prefix in QUICK} else None
