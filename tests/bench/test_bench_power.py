"""The power sampler (``bench_power``) against a fake ``nvidia-smi``, and the harness storing
its medians on a timed row (no GPU here)."""

import datetime
import os
import stat
import sys
import time

import bench_power
from bench_harness import Runner
from test_bench_harness import FakeBenchmark, FakeCase, FakeWorkload, make_state

# Answers the one-field probe with a number (or, for the fields in REJECT, as a driver that
# lacks them does), and the looping query with timestamped lines every 20 ms until stopped.
FAKE_SMI = """\
#!{python}
import datetime, sys, time
REJECT = {reject!r}
query = next(a for a in sys.argv if a.startswith("--query-gpu=")).split("=", 1)[1]
if "-lms" not in sys.argv:
    if query in REJECT:
        print(f'Field "{{query}}" is not a valid field to query.')
        sys.exit(2)
    print("{power}")
    sys.exit(0)
while True:
    now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    print(f"{{now}}, {power}, {clock}, 700.00", flush=True)
    time.sleep(0.02)
"""


def fake_smi(tmp_path, power=650.5, clock=1605, reject=()):
    path = tmp_path / "nvidia-smi"
    path.write_text(FAKE_SMI.format(python=sys.executable, power=power, clock=clock,
                                    reject=tuple(reject)))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    bench_power._chosen_field.clear()
    return str(path)


def sample(executable, seconds=0.4):
    with bench_power.PowerSampler(True, executable) as power:
        time.sleep(0.3)  # the fake's interpreter starting, as nvidia-smi does
        power.timed()
        time.sleep(seconds)
        power.done()
        time.sleep(0.1)  # samples after the rounds: left out
    return power.summary()


def test_medians_of_the_samples_inside_the_rounds(tmp_path):
    summary = sample(fake_smi(tmp_path))
    assert summary["power_w"] == 650.5 and summary["sm_clock_mhz"] == 1605
    assert summary["power_limit_w"] == 700 and summary["power_field"] == "power.draw.instant"
    # 20 ms apart over 0.4 s (a loaded machine prints fewer)
    assert 3 <= summary["power_samples"] <= 21


def test_falls_back_to_the_averaged_power_where_the_driver_lacks_the_instant_one(tmp_path):
    summary = sample(fake_smi(tmp_path, reject=["power.draw.instant"]))
    assert summary["power_field"] == "power.draw" and summary["power_w"] == 650.5


def test_nothing_without_the_tool_or_a_gpu(tmp_path):
    assert sample(str(tmp_path / "missing")) == {}
    with bench_power.PowerSampler(False, fake_smi(tmp_path)) as power:
        power.timed()
        power.done()
    assert power.process is None and power.summary() == {}


def test_a_tool_that_answers_no_power_field_is_not_started(tmp_path):
    executable = fake_smi(tmp_path, reject=bench_power.POWER_FIELDS)
    with bench_power.PowerSampler(True, executable) as power:
        assert power.process is None
    assert power.summary() == {}


def test_samples_outside_the_window_and_unparsable_lines_are_left_out():
    def stamp(seconds):
        return datetime.datetime.fromtimestamp(seconds).strftime(bench_power.TIMESTAMP_FORMAT)

    t = 1_700_000_000.0
    lines = [f"{stamp(t - 1)}, 100, 1980, 700", f"{stamp(t + 0.5)}, 690.5, 1500, 700",
             f"{stamp(t + 0.6)}, [N/A], 1500, 700", "garbage", f"{stamp(t + 2)}, 100, 1980, 700"]
    assert bench_power.parse_samples(lines, t, t + 1) == [(690.5, 1500.0, 700.0)]
    assert bench_power.summarize([], "power.draw") == {}


def test_a_timed_row_stores_the_medians(tmp_path, monkeypatch):
    fake_smi(tmp_path, power=412.0, clock=1980)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(bench_power, "on_gpu", lambda: True)
    benchmark = FakeBenchmark()
    # 0.5 s of timed rounds: the fake tool has started before they begin
    workload = FakeWorkload(seconds=0.01)
    Runner(benchmark, make_state(target_time_s=0.5, max_rounds=10)).run(
        FakeCase(work=1e9, workload=workload))
    info = benchmark.extra_info
    assert "error" not in info
    assert info["power_w"] == 412.0 and info["sm_clock_mhz"] == 1980
    assert info["power_samples"] >= 1


def test_a_failed_row_stores_no_power(tmp_path, monkeypatch):
    fake_smi(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(bench_power, "on_gpu", lambda: True)
    benchmark = FakeBenchmark()
    workload = FakeWorkload(seconds=0.001, error=(4, RuntimeError("boom")))
    Runner(benchmark, make_state()).run(FakeCase(workload=workload))
    assert "boom" in benchmark.extra_info["error"]
    assert "power_w" not in benchmark.extra_info
