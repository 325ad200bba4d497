"""`ballast fleet simulate` and `ballast fleet trace`, run in-process with no server: the results table, the
CSV and the PNG, planner-priced curves, bad traces refused with their line and field, seeded traces."""

from __future__ import annotations

import csv
import re
from dataclasses import replace
from pathlib import Path

import pytest

from ballast.cli.fleet_simulate import binned
from ballast.cli.main import main
from services.planner.elastic import POLICIES, generate_trace, parse_trace, simulate, synthetic_curve

ROOT = Path(__file__).resolve().parents[2]
HEADER = ("name,submit_time_s,model,global_batch_size,iterations,requested_devices,min_devices,max_devices,tenant,"
          "priority")
ROWS = [
    "long,0,bert-huge-32,64,20000,4,2,8,prod,0",
    "tiny,30,gpt-tiny,64,5000,2,1,4,research,0",
    "vit,60,vit-huge-32,128,3000,4,2,8,prod,10",
    "t5,90,t5-large-32,64,2000,2,1,2,vision,0",
    "late,400,swin-huge-32.yaml,64,4000,8,4,8,prod,0",  # a model may be named by its file under examples/
]
NUMBER = r"[-\d.,%]+"


def write(tmp_path: Path, *rows: str, header: str = HEADER) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def table_rows(out: str) -> dict[str, list[str]]:
    """The results table's rows: policy name, then its numbers (other lines may start with a policy too)."""
    return {
        cells[0]: cells[1:]
        for line in out.splitlines()
        if (cells := line.split()) and cells[0] in POLICIES and re.fullmatch(NUMBER, cells[1])
    }


def test_synthetic_curves_give_one_row_per_policy_a_csv_and_a_png(tmp_path, capsys):
    trace, out_csv, out_png = write(tmp_path, *ROWS), tmp_path / "out" / "results.csv", tmp_path / "out" / "jct.png"
    rc = main(
        [
            "fleet",
            "simulate",
            str(trace),
            "--devices",
            "8",
            "--curves",
            "synthetic",
            "--csv",
            str(out_csv),
            "--plot",
            str(out_png),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    rows = table_rows(out)
    assert list(rows) == list(POLICIES) and all(len(cells) == 7 for cells in rows.values())
    models = {"bert-huge-32", "gpt-tiny", "vit-huge-32", "t5-large-32", "swin-huge-32.yaml"}
    jobs = [replace(j, model=j.model.removesuffix(".yaml")) for j in parse_trace(trace.read_text(), models, 8)]
    curves = {(j.model, j.global_batch_size): synthetic_curve(j.model, j.global_batch_size, 8) for j in jobs}
    expected = simulate(jobs, 8, curves=curves)
    for name, r in expected.items():  # the first number after the name is the average JCT in seconds
        assert float(rows[name][0]) == pytest.approx(r.average_jct_s, abs=0.5)
        assert int(rows[name][5]) == r.morphs
    assert "elastic average JCT" in out and "below fifo" in out
    with out_csv.open() as f:
        written = list(csv.DictReader(f))
    assert [r["policy"] for r in written] == list(POLICIES)
    assert float(written[2]["average_jct_s"]) == pytest.approx(expected["elastic"].average_jct_s)
    assert float(written[0]["utilisation"]) == pytest.approx(expected["fifo"].utilisation)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_chosen_policies_run_in_the_order_given(tmp_path, capsys):
    rc = main(
        [
            "fleet",
            "simulate",
            str(write(tmp_path, *ROWS)),
            "--devices",
            "8",
            "--curves",
            "synthetic",
            "--policy",
            "elastic,fifo",
            "--morph-cost",
            "5",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and list(table_rows(out)) == ["elastic", "fifo"] and "morph cost 5 s" in out


def test_planner_curves_price_a_small_trace(tmp_path, capsys):
    trace = write(
        tmp_path,
        "a,0,gpt-tiny,64,200000,2,1,8,prod,0",
        "b,10,gpt-tiny,64,50000,4,2,8,prod,0",
        "c,20,gpt-tiny,64,80000,1,1,2,prod,0",
    )
    rc = main(["fleet", "simulate", str(trace), "--devices", "8", "--workers", "1"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "planner curves on nvidia-a100-80gb" in captured.out and "pricing 1 scaling curve" in captured.err
    rows = table_rows(captured.out)
    assert list(rows) == list(POLICIES) and all(float(cells[0]) > 0 for cells in rows.values())


@pytest.mark.parametrize(
    "rows, header, line, field",
    [
        (ROWS[:2], HEADER.replace(",tenant", ""), 1, "tenant"),  # a missing column
        ([ROWS[0], "x,5,gpt-huge,64,100,2,1,4,prod,0"], HEADER, 3, "model"),  # no such model under examples/
        (["x,5,gpt-tiny,64,100,4,8,2,prod,0"], HEADER, 2, "min_devices"),  # min > max
        (["x,-5,gpt-tiny,64,100,2,1,4,prod,0"], HEADER, 2, "submit_time_s"),  # a negative time
        ([ROWS[0], ROWS[1], "x,5,gpt-tiny,64,100,16,1,16,prod,0"], HEADER, 4, "requested_devices"),  # > the fleet
    ],
)
def test_a_bad_trace_exits_2_naming_its_line_and_field_and_prints_no_result(
    tmp_path, capsys, rows, header, line, field
):
    rc = main(
        ["fleet", "simulate", str(write(tmp_path, *rows, header=header)), "--devices", "8", "--curves", "synthetic"]
    )
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert f"{field}: line {line}:" in captured.err and "Traceback" not in captured.err


def test_a_job_no_plan_fits_on_its_request_is_a_bad_line(tmp_path, capsys):
    trace = write(tmp_path, "ok,0,gpt-tiny,64,100,1,1,1,prod,0", "huge,5,gpt3-15b,64,10,1,1,1,prod,0")
    rc = main(["fleet", "simulate", str(trace), "--devices", "8", "--workers", "1"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == "" and "requested_devices: line 3: gpt3-15b" in captured.err


def test_an_unknown_policy_or_device_kind_is_refused(tmp_path, capsys):
    trace = str(write(tmp_path, *ROWS))
    with pytest.raises(SystemExit) as exit_:
        main(["fleet", "simulate", trace, "--devices", "8", "--policy", "fifo,lottery"])
    assert exit_.value.code == 2 and "unknown policy 'lottery'" in capsys.readouterr().err
    assert main(["fleet", "simulate", trace, "--devices", "8", "--device-kind", "tpu-v9"]) == 2
    assert "device: unknown device 'tpu-v9'" in capsys.readouterr().err


def test_fleet_trace_writes_the_seeded_trace_the_benchmark_commits(tmp_path, capsys):
    out = tmp_path / "elastic-160.csv"
    assert main(["fleet", "trace", "--jobs", "160", "--seed", "20", "--devices", "64", str(out)]) == 0
    assert out.read_text() == (ROOT / "benchmarks" / "traces" / "elastic-160.csv").read_text()
    assert (
        main(
            [
                "fleet",
                "trace",
                "--jobs",
                "5",
                "--seed",
                "3",
                "--devices",
                "8",
                "--models",
                "gpt-tiny",
                "--mean-interarrival",
                "60",
                str(out),
            ]
        )
        == 0
    )
    assert parse_trace(out.read_text(), {"gpt-tiny"}, 8) == generate_trace(
        5, 3, ["gpt-tiny"], fleet_devices=8, mean_interarrival_s=60.0
    )
    assert main(["fleet", "trace", "--jobs", "5", "--seed", "3", "--devices", "8", "--models", "llama", str(out)]) == 2
    assert "models: unknown model 'llama'" in capsys.readouterr().err
    args = ["fleet", "trace", "--jobs", "5", "--seed", "3", "--devices", "8", "--models", "gpt-tiny", "--batches",
            "64,6400", "--sizes", "3,6", "--median-samples", "1e5", str(out)]
    assert main(args) == 0
    assert parse_trace(out.read_text(), {"gpt-tiny"}, 8) == generate_trace(
        5, 3, ["gpt-tiny"], fleet_devices=8, mean_interarrival_s=180.0, global_batches=(64, 6400), sizes=(3, 6),
        median_samples=1e5)
    assert main([*args[:-1], "--sizes", "3,x", str(out)]) == 2
    assert "sizes: --sizes '3,x' is not a comma list of positive integers" in capsys.readouterr().err


def test_utilisation_is_averaged_over_time_bins():
    edges, held = binned([(0.0, 0), (10.0, 4), (30.0, 0)], 0.0, 40.0, 4)
    assert edges == [0.0, 10.0, 20.0, 30.0, 40.0] and held == [0.0, 4.0, 4.0, 0.0]
    assert binned([(5.0, 2), (15.0, 0)], 0.0, 20.0, 2)[1] == [1.0, 1.0]
