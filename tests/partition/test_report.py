"""The partition report: AOTFORGE_LOG=partition and explain_partition."""
from __future__ import annotations

from aotforge.partition import explain_partition, min_cut_rematerialization_partition
from aotforge.partition.op_costs import node_bytes

from .joints import CASES, capture_joint, saved_nodes


def test_log_lists_saved_tensors_recomputation_and_totals(monkeypatch, capsys) -> None:
    joint = capture_joint(CASES["mlp"])
    monkeypatch.setenv("AOTFORGE_LOG", "partition")
    fw, _ = min_cut_rematerialization_partition(
        joint.module, joint.inputs, num_fwd_outputs=joint.num_fwd_outputs
    )
    err = capsys.readouterr().err
    assert "aotforge partition: min_cut_report" in err
    saved = saved_nodes(fw, joint.num_fwd_outputs)
    total = sum(node_bytes(n) for n in saved)
    assert f"saved for backward: {len(saved)} tensors, {total:,} bytes (default partition:" in err
    for node in saved:
        assert f"  {node.name} " in err
    assert "recomputed in backward:" in err and "aten.gelu" in err
    assert "activation memory budget: 1.0" in err
    assert "estimated backward peak:" in err


def test_explain_partition_reports_the_budget() -> None:
    joint = capture_joint(CASES["cnn"])
    text = explain_partition(
        joint.module, joint.inputs, num_fwd_outputs=joint.num_fwd_outputs, memory_budget=0.0
    )
    assert "activation memory budget: 0.0" in text
    assert "default partition:" in text
    assert "aten.convolution" in text  # budget 0 recomputes the convolutions too
