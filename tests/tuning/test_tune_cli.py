"""`orca-jax tune` end to end on the tiny model: it measures, searches, writes a TOML, starts
`orca-jax serve --config` with it and replays the workload; and its arguments are checked."""

import json
import subprocess
import sys

import pytest

from orca_jax.cli import main
from orca_jax.config import REPO_ROOT, EngineConfig, load_toml
from orca_jax.tuning.search import p99

TINY = REPO_ROOT / "checkpoints" / "tiny"
SMALL = ["--model", str(TINY), "--slo-ttft-p99", "0.5", "--slo-tpot-p99", "0.1",
         "--prompt-len-dist", "uniform:4:40", "--output-len-dist", "uniform:4:40", "--num-requests", "40",
         "--policies", "orca", "chunked", "--max-num-seqs", "2,4", "--max-num-batched-tokens", "16,64",
         "--kv-cache-memory", "32KiB,256KiB,1MiB"]


def test_tune_on_the_tiny_model_writes_a_toml_the_server_starts_with(tmp_path):
    out, report = tmp_path / "tuned.toml", tmp_path / "tune.json"
    result = subprocess.run([sys.executable, "-m", "orca_jax.cli", "tune", *SMALL, "--measure-seconds", "2",
                             "--out", str(out), "--report", str(report)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    config = load_toml(EngineConfig, out)  # what `serve --config` reads
    settings = data["settings"]
    assert (config.scheduler.policy, config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
            config.cache.kv_cache_memory) == (settings["policy"], settings["max_num_seqs"],
                                              settings["max_num_batched_tokens"], settings["kv_cache_memory"])
    assert config.model == str(TINY) and settings["kv_cache_memory"] in (256 << 10, 1 << 20)
    # The verifying run served every request from a server started with that file.
    measured, predicted = data["measured"], data["predicted"]
    assert measured["ok"] == measured["requests"] == 40 and measured["errors"] == []
    for side in (predicted, measured):
        assert side["ttft_p99_s"] > 0 and side["tpot_p99_s"] > 0 and side["rate_rps"] > 0
    assert measured["rate_rps"] == predicted["rate_rps"]
    # It was served at the recommended rate, the largest that meets the target with every step 10%
    # dearer: below the nominal capacity, which the report and the TOML's header give beside it.
    assert data["cost_margin"] == 0.1 and data["nominal_capacity_rps"] > predicted["rate_rps"]
    assert f"nominal capacity {data['nominal_capacity_rps']:.3g} req/s" in out.read_text()
    # Each request's TTFT and TPOT, simulated and measured side by side, make up the p99s above.
    rows = data["per_request"]
    assert len(rows) == 40 and all(r["ttft_s"] > 0 and r["sim_ttft_s"] > 0 and r["send_lag_s"] >= 0 for r in rows)
    assert [r["output_tokens"] for r in rows] == [r["max_tokens"] for r in rows]  # the same request on each row
    assert p99([r["ttft_s"] for r in rows]) == pytest.approx(measured["ttft_p99_s"])
    assert p99([r["sim_ttft_s"] for r in rows]) == pytest.approx(predicted["ttft_p99_s"])
    assert p99([r["sim_tpot_s"] for r in rows]) == pytest.approx(predicted["tpot_p99_s"])
    # The memory plan refused the KV budget too small for one 128-token sequence; it was never tried.
    assert any(r["settings"] == "kv=0.03125MiB" and "memory plan" in r["reason"] for r in data["refused"])
    assert not any("kv=0.03125MiB" in c["settings"] for c in data["candidates"])
    fit = data["measurement"]["cost_model"]["fit_error"]
    assert fit["decode"]["rows"] > 3 and fit["prefill"]["rows"] > 4
    assert "predicted" in result.stdout and "measured" in result.stdout and (tmp_path / "tune.png").is_file()

    # The measurement, reused: the same search gives the same settings, with no engine started.
    again = tmp_path / "again.toml"
    rerun = subprocess.run([sys.executable, "-m", "orca_jax.cli", "tune", *SMALL, "--cost-model", str(report),
                            "--no-verify", "--out", str(again)], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert load_toml(EngineConfig, again) == config


@pytest.mark.parametrize("flags, message", [
    (["--prompt-len-dist", "zipf:0:10"], "give zipf:LO:HI[:ALPHA]"),
    (["--max-num-seqs", "8,x"], "positive integers"),
    (["--kv-cache-memory", "1 parsec"], "cannot read"),
    (["--cost-margin", "-0.1"], "give a fraction >= 0"),
    (["--cost-margin", "inf"], "give a fraction >= 0"),
])
def test_bad_arguments_name_the_problem(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "--slo-ttft-p99", "1", "--slo-tpot-p99", "0.1", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_workload_longer_than_the_model_is_an_error_line(tmp_path, capsys):
    measured = {"cost_model": {"decode": {"base_s_by_seq_bucket": {"1": 0.01}, "per_1k_attended_s": 0.0},
                               "prefill": {"base_s_by_token_bucket": {"1": 0.01}, "per_seq_s": 0.0,
                                           "per_1k_attended_s": 0.0}},
                "kv_pages": {str(1 << 20): 128}, "max_model_len": 128, "page_size": 16}
    (tmp_path / "m.json").write_text(json.dumps(measured))
    code = main(["tune", "--model", str(TINY), "--slo-ttft-p99", "1", "--slo-tpot-p99", "0.1",
                 "--prompt-len-dist", "equal:100", "--output-len-dist", "equal:100", "--kv-cache-memory", "1MiB",
                 "--cost-model", str(tmp_path / "m.json"), "--no-verify", "--out", str(tmp_path / "t.toml")])
    assert code == 2 and "more than max_model_len=128" in capsys.readouterr().err


def test_a_cost_margin_at_a_given_rate_is_an_error_line(capsys):
    code = main(["tune", "--slo-ttft-p99", "1", "--slo-tpot-p99", "0.1", "--arrival-rate", "2", "--cost-margin", "0.2"])
    assert code == 2 and "--cost-margin sets the margin under which --max-rate recommends" in capsys.readouterr().err
