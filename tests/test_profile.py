"""The profiling API (`mlxfun.bench.profile`): trace counts, timings present, and the step's graph."""

from helpers import tiny_config, tiny_model

from mlxfun.bench import profile


def test_profile_generation_reports_one_trace_and_the_step_graph():
    config = tiny_config(num_layers=3)
    model = tiny_model(config)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    p = profile.profile_generation(model, prompts, max_tokens=8, matmuls=False, pipelined=True)
    assert p.batch == 2 and p.steps == 7
    assert p.traces == 1  # one compiled decode step for the whole generation
    assert p.first_step_s >= p.first_step_host_s > 0 and p.steady_step_s > 0
    assert 0 < p.steady_call_s <= p.steady_host_s  # the call is part of the host time
    assert p.pipelined_step_s > 0 and p.tokens_per_s > 0
    # Per layer: q/k/v, output, gate/up and down maps plus two attention products; then the head.
    assert p.graph_nodes["Matmul"] == 6 * config.num_layers + 1
    # The cache is written by one-slot scatters (keys and values per layer, and the slot positions),
    # not by slice updates at an array-valued start (on CUDA those copy the whole buffer).
    assert p.graph_nodes["ScatterAxis"] == 2 * config.num_layers + 1
    assert "SliceUpdate" not in p.graph_nodes


def test_report_table_and_json_carry_every_batch():
    model = tiny_model(tiny_config())
    report = profile.profile(model, [1, 3], prompt_tokens=4, max_tokens=4, matmuls=True, pipelined=False)
    assert [b.batch for b in report.batches] == [1, 3]
    assert all(b.matmul_s > 0 and sum(b.graph_nodes.values()) > 0 for b in report.batches)
    lines = report.table().splitlines()
    assert len(lines) == 3 + 2 and lines[1].split()[-1] == "nodes"
    data = report.to_json()
    assert [b["batch"] for b in data["batches"]] == [1, 3] and data["batches"][1]["tokens_per_s"] > 0
