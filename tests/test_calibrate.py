"""`autopar calibrate`: the fits recover synthetic numbers, the cluster it builds
loads and plans, and one tiny real run through the CLI (no timing asserts)."""
import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import autopar
import cost_models
from autopar import calibrate as cal
from autopar.cli import app
from cost_models.comm import MeshTopology, collective_time
from cost_models.hardware import LinkSpec

TINY = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128"
LINK = LinkSpec(bandwidth=2e9, latency=50e-6)
SIZES = [4096 * 4 ** i for i in range(7)]          # 4 KiB .. 16 MiB


def _coll_points(noise=0.0, seed=0, groups=(2, 4)):
    rng = np.random.default_rng(seed)
    pts = []
    for kind in cal.KINDS:
        for g in groups:
            for n in SIZES:
                t = collective_time(kind, n, g, LINK)
                pts.append((kind, g, n, t * float(rng.lognormal(0, noise)) if noise else t))
    return pts


def _synthetic(procs=4, peak=20e9, eff=(1.0, 0.9, 0.8, 0.6, 0.5), overhead=5e-6, copy_bw=10e9,
               ew_bw=(6e9, 7e9, 8e9, 9e9), extra_dtype="bfloat16"):
    """Measurements as `measure` returns them, from known hardware numbers."""
    shapes = [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 512, 512), (256, 2048, 2048)]
    mm = [{"dtype": "float32", "m": m, "k": k, "n": n, "seconds": 2 * m * k * n / (peak * e) + overhead}
          for (m, k, n), e in zip(shapes, eff)]
    mm.append({"dtype": extra_dtype, "m": 256, "k": 256, "n": 256, "seconds": 2 * 256 ** 3 / 1e9 + overhead})
    copy = [{"op": "copy", "bytes": 2 * b, "seconds": 2 * b / bw} for b, bw in
            ((16 << 20, copy_bw * 0.9), (32 << 20, copy_bw))]
    ew = [{"op": op, "bytes": 2 * (16 << 20), "seconds": 2 * (16 << 20) / bw} for op, bw in zip(cal.ELEMENTWISE, ew_bw)]
    coll = [{"kind": k, "group": g, "bytes": n, "seconds": t}
            for k, g, n, t in _coll_points(groups=cal.group_sizes(procs))]
    return {"mode": "quick", "procs": procs, "threads": 1, "cuda": False, "backend": "gloo", "reps": 3,
            "coll_reps": 3, "memory_bytes": 8 << 30, "matmul": mm, "overhead": {"seconds": overhead, "calls": 100},
            "copy": copy, "elementwise": ew, "collectives": coll}


# ------------------------------------------------------------------------------- fits
@pytest.mark.parametrize("kind", cal.KINDS)
def test_fit_collectives_recovers_exact_alpha_beta(kind):
    fits = cal.fit_collectives(p for p in _coll_points() if p[0] == kind)
    assert set(fits) == {kind} and set(fits[kind]) == {"2", "4"}
    for g in (2, 4):
        alpha = collective_time(kind, 0, g, LINK)
        beta = collective_time(kind, 1e9, g, LINK) / 1e9 - alpha / 1e9
        assert fits[kind][str(g)]["alpha"] == pytest.approx(alpha, rel=1e-6)
        assert fits[kind][str(g)]["beta"] == pytest.approx(beta, rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_collectives_with_noise_stays_close(seed):
    fits = cal.fit_collectives(_coll_points(noise=0.05, seed=seed))
    for kind in cal.KINDS:
        for g in (2, 4):
            alpha = collective_time(kind, 0, g, LINK)
            beta = collective_time(kind, 1e9, g, LINK) / 1e9 - alpha / 1e9
            assert fits[kind][str(g)]["alpha"] == pytest.approx(alpha, rel=0.2)
            assert fits[kind][str(g)]["beta"] == pytest.approx(beta, rel=0.2)


def test_link_from_fits_inverts_the_ring_formulas():
    lat, bw = cal.link_from_fits(cal.fit_collectives(_coll_points()))
    assert lat == pytest.approx(LINK.latency, rel=1e-6) and bw == pytest.approx(LINK.bandwidth, rel=1e-6)
    assert cal.link_from_fits({}) is None


def test_fit_matmul_recovers_peak_and_median_efficiency():
    pts = [("float32", 2 * 1024 ** 3, 2 * 1024 ** 3 / (20e9 * e) + 1e-5) for e in (1.0, 0.9, 0.8, 0.6, 0.5)]
    pts.append(("bfloat16", 2 * 512 ** 3, 2 * 512 ** 3 / 1e9 + 1e-5))
    peak, eff = cal.fit_matmul(pts, "float32", overhead_s=1e-5)
    assert peak["float32"] == pytest.approx(20e9) and peak["bfloat16"] == pytest.approx(1e9)
    assert eff == pytest.approx(0.8)
    # efficiency follows the compute dtype
    assert cal.fit_matmul(pts, "bfloat16", 1e-5)[1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no float16"):
        cal.fit_matmul(pts, "float16")
    with pytest.raises(ValueError):
        cal.fit_matmul([("float32", 0, 1.0)], "float32")


def test_fit_memory_and_overhead():
    bw, eff = cal.fit_memory([(1e9, 0.2), (2e9, 0.2)], [(6e8, 0.1), (7e8, 0.1), (2e9, 0.1)])
    assert bw == pytest.approx(10e9) and eff == pytest.approx(0.7)
    assert cal.fit_memory([(1e9, 0.1)], [(5e9, 0.1)])[1] == 1.0       # kept <= 1 (cache-resident)
    assert cal.fit_overhead([3e-6, 5e-6, 100e-6]) == 5e-6
    with pytest.raises(ValueError):
        cal.fit_memory([], [(1, 1)])


def test_sizes_and_group_sizes():
    assert cal.group_sizes(4) == [2, 4] and cal.group_sizes(3) == [2] and cal.group_sizes(1) == []
    for cuda in (False, True):
        for mode in cal.MODES:
            s = cal.sizes_for(mode, cuda)
            assert s.matmul and s.reps >= 2 and all(n % (4 * 8) == 0 for n in s.coll_bytes)
    with pytest.raises(ValueError, match="valid: full, quick, tiny"):
        cal.sizes_for("huge", False)


# ------------------------------------------------------------------------------- the cluster
def test_build_cluster_validates_loads_and_evaluates(tmp_path):
    d = cal.build_cluster(_synthetic(), "cpu", host="testhost", date="2025-01-01")
    base = cost_models.load_cluster("cpu")
    assert d["name"] == "cpu-calibrated"
    assert d["devices_per_node"] == base.devices_per_node and d["max_nodes"] == base.max_nodes
    dev = d["device"]
    assert dev["peak_flops"] == pytest.approx({"float32": 20e9, "bfloat16": 1e9})
    assert dev["matmul_efficiency"] == pytest.approx(0.8)
    assert dev["kernel_overhead_s"] == pytest.approx(5e-6)
    assert dev["memory_bandwidth"] == pytest.approx(10e9) and dev["memory_efficiency"] == pytest.approx(0.75)
    assert dev["memory_bytes"] == 8 << 30
    assert d["intra_node"]["latency"] == pytest.approx(LINK.latency, rel=1e-6)
    assert d["intra_node"]["bandwidth"] == pytest.approx(LINK.bandwidth, rel=1e-6)
    assert d["inter_node"] == base.to_dict()["inter_node"]

    # every measured number has a source naming the host and date
    measured = ([f"device.peak_flops.{k}" for k in dev["peak_flops"]]
                + [f"device.{k}" for k in ("matmul_efficiency", "kernel_overhead_s", "memory_bandwidth",
                                           "memory_efficiency")]
                + [f"collectives.intra_node.{k}" for k in cal.KINDS] + ["intra_node.latency", "intra_node.bandwidth"])
    for key in measured:
        assert d["sources"][key].startswith("measured by autopar calibrate on testhost 2025-01-01"), key
    assert "testhost" in d["sources"]["device.memory_bytes"]

    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(d))
    spec = cost_models.load_cluster(path)
    assert spec.to_dict() == d
    # the overrides are what the comm model uses, per group size, with the comm nbytes convention
    topo = MeshTopology(spec, (2, 2))
    fit = d["collectives"]["intra_node"]["all_gather"]["2"]
    assert topo.collective_time("all_gather", 1 << 20, 1) == pytest.approx(fit["alpha"] + fit["beta"] * (1 << 20))
    assert topo.collective_time("all_gather", 1 << 20, 1) == pytest.approx(
        collective_time("all_gather", 1 << 20, 2, LINK), rel=1e-6)

    est = autopar.evaluate(TINY, cluster=str(path), devices=4, strategy="dp=2,tp=2", global_batch=8)
    assert math.isfinite(est.step_time_s) and est.step_time_s > 0 and est.tp_comm_time_s > 0 and est.fits


def test_build_cluster_keeps_a_gpu_base_and_uses_its_compute_dtype():
    meas = _synthetic(procs=2, extra_dtype="bfloat16")
    d = cal.build_cluster(meas, "dgx-h100", host="h", date="d")
    assert d["name"] == "dgx-h100-calibrated" and d["devices_per_node"] == 8
    # mixed precision: the efficiency comes from the bfloat16 point (its own peak)
    assert d["device"]["matmul_efficiency"] == pytest.approx(1.0)
    assert set(d["collectives"]["intra_node"]["all_reduce"]) == {"2"}
    assert "tf32" not in d["device"]["peak_flops"] and "device.peak_flops.tf32" not in d["sources"]
    # a calibrated file as base is not renamed twice, and one process leaves the links alone
    one = {**_synthetic(procs=1), "collectives": []}
    again = cal.build_cluster(one, d, host="h", date="d")
    assert again["name"] == "dgx-h100-calibrated" and again["intra_node"] == d["intra_node"]


def test_bad_base_fails_before_running(tmp_path):
    res = CliRunner().invoke(app, ["calibrate", "--quick", "--base", "nope", "--out", str(tmp_path / "c.json")])
    assert res.exit_code == 2 and "unknown cluster preset" in res.stderr and "Traceback" not in res.output
    assert not (tmp_path / "c.json").exists()


def test_cli_tiny_real_run_writes_a_loadable_cluster(tmp_path):
    """One real run, with the hidden tiny size set (a few seconds of benchmarks)."""
    path = tmp_path / "cluster.json"
    res = CliRunner().invoke(app, ["calibrate", "--procs", "2", "--out", str(path), "--json"],
                             env={cal.SIZES_ENV: "tiny"})
    assert res.exit_code == 0, f"{res.stdout}\n{res.stderr}\n{res.exception!r}"
    d = json.loads(res.stdout)
    spec = cost_models.load_cluster(path)
    # the base preset is the machine's kind: "cpu" here, the closest DGX preset on a CUDA machine
    assert spec.to_dict() == d and spec.name == f"{cal._default_base()}-calibrated"
    import torch
    if not torch.cuda.is_available() or torch.cuda.device_count() >= 2:   # NCCL: one GPU per process
        assert set(d["collectives"]["intra_node"]) == set(cal.KINDS)
        assert all(set(v) == {"2"} for v in d["collectives"]["intra_node"].values())
    assert {"float32", "bfloat16"} <= set(d["device"]["peak_flops"])
    assert "tiny sizes" in d["description"]


def test_fit_framework_recovers_dispatch_overhead():
    # 60 ops, 40 of them costed with a 5 us kernel overhead, 20 us dispatch per op and pass
    ops, costed, k, d = 60, 40, 5e-6, 20e-6
    step = 3 * ops * d + 3 * costed * k
    assert cal.fit_framework(step, ops, costed, k) == pytest.approx(d)
    assert cal.fit_framework(1e-9, ops, costed, k) == 0.0       # never negative
    with pytest.raises(ValueError):
        cal.fit_framework(1e-3, 0, 0, k)


def test_framework_measurement_lands_in_the_cluster(tmp_path):
    meas = _synthetic()
    meas["framework"] = {"step_s": 3e-3, "ops": 50, "costed_ops": 30, "tensors": 16,
                         "optimizer_s": {"adamw": 1e-4, "sgd": 1e-5}}
    d = cal.build_cluster(meas, "cpu", host="h", date="d")
    spec = cost_models.load_cluster(d)
    assert spec.device.dispatch_overhead_s == pytest.approx(cal.fit_framework(3e-3, 50, 30,
                                                                               spec.device.kernel_overhead_s))
    assert spec.device.optimizer_overhead_s["adamw"] == 1e-4
    assert spec.device.optimizer_overhead_s["sgd_momentum"] > 0          # kept from the preset
    assert "device.dispatch_overhead_s" in spec.sources


def test_selective_checkpoint_overhead_is_measured_fitted_and_lands_in_the_cluster():
    # the fit: the dispatch mode's extra time over two passes of every op
    assert cal.fit_checkpoint(5e-3, 3e-3, 25) == pytest.approx(2e-3 / 50)
    assert cal.fit_checkpoint(1e-3, 2e-3, 25) == 0.0       # noise never gives a negative overhead
    with pytest.raises(ValueError):
        cal.fit_checkpoint(1e-3, 1e-3, 0)
    # the measurement runs torch's selective checkpoint on this machine: it costs something
    ck = cal._checkpoint_overhead(3, torch.device("cpu"), lambda: None)
    assert ck["ops"] > 20 and ck["selective_s"] > ck["full_s"] > 0
    meas = _synthetic()
    meas["checkpoint"] = {"selective_s": 5e-3, "full_s": 3e-3, "ops": 25}
    spec = cost_models.load_cluster(cal.build_cluster(meas, "cpu", host="h", date="d"))
    assert spec.device.checkpoint_dispatch_s == pytest.approx(4e-5)
    assert spec.sources["device.checkpoint_dispatch_s"].startswith("measured by autopar calibrate on h d")
