"""Tests of the standalone cost_models package (fast, no timing asserts)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cost_models import (ClusterError, ClusterSpec, DeviceSpec, LinkSpec, MeshTopology,
                         collective_time, dtype_bytes, fit_alpha_beta, list_presets,
                         load_cluster, model_state_bytes, op_time, zero_sharded_state_bytes)

PRESETS = ("cpu", "dgx-a100-80g", "dgx-h100")


def _numeric_paths(d: dict, prefix: str = "") -> list[str]:
    """Dotted paths of the numbers of a cluster dict (sources and fits excluded)."""
    out = []
    for k, v in d.items():
        path = f"{prefix}{k}"
        if k in ("sources", "collectives"):
            continue
        if isinstance(v, dict):
            out += _numeric_paths(v, path + ".")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(path)
    return out


# ---- presets and cluster files ------------------------------------------------

def test_list_presets():
    assert set(PRESETS) <= set(list_presets())


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_with_a_source_for_every_number(name):
    spec = load_cluster(name)
    assert spec.name == name
    paths = _numeric_paths(spec.to_dict())
    assert "device.peak_flops.float32" in paths
    missing = [p for p in paths if not spec.sources.get(p)]
    assert not missing, f"{name}: numbers without a source: {missing}"


def test_preset_numbers():
    a100, h100, cpu = (load_cluster(n) for n in ("dgx-a100-80g", "dgx-h100", "cpu"))
    assert a100.device.flops("float32") == 19.5e12  # not the TF32 number
    assert a100.device.flops("tf32") == 156e12
    assert a100.device.flops("bfloat16") == 312e12
    assert a100.intra_node.bandwidth == 300e9 and a100.inter_node.bandwidth == 25e9
    assert h100.device.flops("bfloat16") == 989e12
    assert h100.intra_node.bandwidth == 450e9 and h100.inter_node.bandwidth == 50e9
    assert a100.compute_dtype == "bfloat16" and cpu.compute_dtype == "float32"
    assert cpu.devices_per_node == 64 and cpu.device.memory_bytes == 24 * 2**30


def test_unknown_dtype_names_valid_ones():
    with pytest.raises(ClusterError, match="float32"):
        load_cluster("cpu").device.flops("tf32")


@pytest.mark.parametrize("name", PRESETS)
def test_dict_and_json_round_trip(name, tmp_path):
    spec = load_cluster(name)
    d = spec.to_dict()
    assert list(d) == sorted(d) and list(d["device"]) == sorted(d["device"])
    assert ClusterSpec.from_dict(d) == spec
    assert hash(ClusterSpec.from_dict(d)) == hash(spec)  # usable as a cache key
    path = tmp_path / "c.json"
    path.write_text(json.dumps(d))
    assert load_cluster(path) == spec
    assert load_cluster(str(path)) == spec
    assert load_cluster(d) == spec and load_cluster(spec) is spec


def test_round_trip_with_collective_overrides():
    d = load_cluster("cpu").to_dict()
    d["collectives"] = {"intra_node": {
        "all_reduce": {"alpha": 1e-4, "beta": 1e-9},
        "all_gather": {"2": {"alpha": 1e-4, "beta": 1e-9}, "4": {"alpha": 2e-4, "beta": 2e-9}}}}
    spec = ClusterSpec.from_dict(d)
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    assert spec.to_dict() == d


def test_unknown_preset_lists_names():
    with pytest.raises(ClusterError) as e:
        load_cluster("dgx-b300")
    for name in PRESETS:
        assert name in str(e.value)


def test_missing_file():
    with pytest.raises(ClusterError, match="does not exist"):
        load_cluster("/nonexistent/cluster.json")


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d["device"].pop("memory_bandwidth"), ["memory_bandwidth"]),
    (lambda d: d["intra_node"].update(bandwidth="fast"), ["intra_node.bandwidth"]),
    (lambda d: d.update(default_precision="fp8"), ["default_precision"]),
    (lambda d: d["device"]["peak_flops"].update(fp64=1e12), ["peak_flops", "fp64"]),
    (lambda d: d.update(devices_per_nod=8), ["devices_per_nod"]),
    (lambda d: d.update(collectives={"intra_node": {"all_reduce": {"alpha": 1.0}}}),
     ["collectives"]),
    # JSON Schema's bounds let NaN (compares false) and Infinity through; they gave step_time_s NaN, fits true
    (lambda d: d["intra_node"].update(bandwidth=float("nan")), ["intra_node.bandwidth", "finite"]),
    (lambda d: d["device"]["peak_flops"].update(bfloat16=float("inf")), ["device.peak_flops.bfloat16", "finite"]),
])
def test_malformed_file_names_file_and_key(tmp_path, mutate, words):
    d = load_cluster("dgx-a100-80g").to_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ClusterError) as e:
        load_cluster(path)
    assert "bad.json" in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_invalid_json_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ClusterError, match="broken.json"):
        load_cluster(path)


def test_check_devices():
    a100 = load_cluster("dgx-a100-80g")
    assert a100.check_devices(4) == 1 and a100.check_devices(8) == 1
    assert a100.check_devices(128) == 16
    for bad in (0, -8, 12):
        with pytest.raises(ClusterError):
            a100.check_devices(bad)
    with pytest.raises(ClusterError, match="max_nodes|at most"):
        load_cluster("cpu").check_devices(128)


# ---- compute -------------------------------------------------------------------

DEV = DeviceSpec(name="toy", memory_bytes=2**30, peak_flops={"float32": 1e12, "bfloat16": 4e12},
                 memory_bandwidth=1e11, matmul_efficiency=0.5, memory_efficiency=0.8)


def test_roofline_compute_bound():
    # 1e12 flops at 0.5e12 FLOP/s = 2 s; 1e6 bytes at 0.8e11 B/s is negligible.
    assert op_time(DEV, 1e12, 1e6) == pytest.approx(2.0)
    assert op_time(DEV, 1e12, 1e6, dtype="bfloat16") == pytest.approx(0.5)


def test_roofline_unaligned_matmul():
    # a product with a dimension off 16 bytes runs at unaligned_matmul_efficiency; 0 keeps the aligned rate
    import dataclasses
    slow = dataclasses.replace(DEV, unaligned_matmul_efficiency=DEV.matmul_efficiency / 4)
    assert op_time(slow, 1e12, 1e6, aligned=False) == pytest.approx(4 * op_time(slow, 1e12, 1e6))
    assert op_time(DEV, 1e12, 1e6, aligned=False) == pytest.approx(op_time(DEV, 1e12, 1e6))
    assert op_time(slow, 1e9, 8e10, family="other", aligned=False) == pytest.approx(1.0)


def test_roofline_bandwidth_bound():
    # 8e10 bytes at 0.8e11 B/s = 1 s; 1e9 flops is negligible.
    assert op_time(DEV, 1e9, 8e10) == pytest.approx(1.0)
    assert op_time(DEV, 1e9, 8e10, family="other") == pytest.approx(1.0)


def test_roofline_other_family_uses_vector_rate_and_overhead():
    # Elementwise bf16 does not get the tensor-core rate: 8e11 / (1e12 * 0.8) = 1 s.
    assert op_time(DEV, 8e11, 0, dtype="bfloat16", family="other") == pytest.approx(1.0)
    dev = DeviceSpec(**{**DEV.__dict__, "kernel_overhead_s": 1e-5})
    assert op_time(dev, 0, 0) == pytest.approx(1e-5)
    with pytest.raises(ValueError, match="matmul"):
        op_time(DEV, 1, 1, family="gemm")
    with pytest.raises(ClusterError):
        op_time(DEV, 1, 1, dtype="float16")


# ---- memory --------------------------------------------------------------------

def test_model_state_bytes():
    n = 1000
    assert model_state_bytes(n, "adamw", "fp32") == {
        "weights": 4000, "gradients": 4000, "optimizer": 8000, "total": 16000}
    assert model_state_bytes(n, "adam", "mixed") == {
        "weights": 2000, "gradients": 2000, "optimizer": 12000, "total": 16000}
    assert model_state_bytes(n, "sgd", "fp32")["total"] == 8000
    assert model_state_bytes(n, "sgd", "mixed")["optimizer"] == 4000
    assert model_state_bytes(n, "sgd_momentum", "fp32")["optimizer"] == 4000
    assert model_state_bytes(n, "sgd_momentum", "mixed")["optimizer"] == 8000
    with pytest.raises(ValueError, match="adamw"):
        model_state_bytes(n, "lion")
    with pytest.raises(ValueError, match="mixed"):
        model_state_bytes(n, precision="fp8")


def test_zero_sharding():
    s = model_state_bytes(1000, "adamw", "mixed")  # 2000, 2000, 12000
    assert zero_sharded_state_bytes(s, 4, 0) == s
    assert zero_sharded_state_bytes(s, 4, 1) == {
        "weights": 2000, "gradients": 2000, "optimizer": 3000, "total": 7000}
    assert zero_sharded_state_bytes(s, 4, 2)["total"] == 2000 + 500 + 3000
    assert zero_sharded_state_bytes(s, 4, 3)["total"] == 16000 // 4
    assert zero_sharded_state_bytes(s, 3, 3)["weights"] == 667  # padded shard
    with pytest.raises(ValueError):
        zero_sharded_state_bytes(s, 4, 4)
    with pytest.raises(ValueError):
        zero_sharded_state_bytes(s, 0, 1)


def test_dtype_bytes():
    assert [dtype_bytes(d) for d in ("float32", "bfloat16", "float16", "int64")] == [4, 2, 2, 8]
    with pytest.raises(ValueError, match="float32"):
        dtype_bytes("fp8")


# ---- communication -------------------------------------------------------------

LINK = LinkSpec(bandwidth=1e9, latency=1e-5)


@pytest.mark.parametrize("kind, expected", [
    # p = 4, n = 1e9 bytes: n/B = 1 s.
    ("all_reduce", 6 * 1e-5 + 1.5),
    ("all_gather", 3 * 1e-5 + 0.75),
    ("reduce_scatter", 3 * 1e-5 + 0.75),
    ("all_to_all", 3 * 1e-5 + 0.75),
    ("send_recv", 1e-5 + 1.0),
    ("broadcast", 3 * 1e-5 + 1.0),
])
def test_collective_formulas(kind, expected):
    assert collective_time(kind, 1e9, 4, LINK) == pytest.approx(expected)
    assert collective_time(kind, 1e9, 1, LINK) == 0.0


def test_collective_errors():
    with pytest.raises(ValueError, match="all_reduce"):
        collective_time("allreduce", 1, 2, LINK)
    with pytest.raises(ValueError):
        collective_time("all_reduce", 1, 0, LINK)


def test_collective_overrides():
    flat = {"all_reduce": {"alpha": 1.0, "beta": 2.0}}
    assert collective_time("all_reduce", 3, 8, LINK, flat) == 7.0
    assert collective_time("all_gather", 1e9, 4, LINK, flat) == pytest.approx(3e-5 + 0.75)
    per_size = {"all_reduce": {"2": {"alpha": 1.0, "beta": 0.0}, "8": {"alpha": 5.0, "beta": 0.0}}}
    assert collective_time("all_reduce", 1, 2, LINK, per_size) == 1.0
    assert collective_time("all_reduce", 1, 4, LINK, per_size) == 1.0  # nearest: 2
    assert collective_time("all_reduce", 1, 5, LINK, per_size) == 5.0  # tie: larger, 8
    assert collective_time("all_reduce", 1, 64, LINK, per_size) == 5.0


def test_mesh_link_selection():
    a100 = load_cluster("dgx-a100-80g")
    mesh = MeshTopology(a100, (16, 8))  # (dp, tp) on 16 nodes
    assert mesh.axis_link(1) == a100.intra_node and not mesh.spans_nodes(1)
    assert mesh.axis_link(0) == a100.inter_node and mesh.spans_nodes(0)
    assert mesh.axis_link(-1) == a100.intra_node
    small = MeshTopology(a100, (4, 2))
    assert small.axis_link(0) == small.axis_link(1) == a100.intra_node
    # (2, 3, 4) on 3 nodes of 8: groups of axis 1 (ranks 0, 4, 8) straddle nodes
    # although 3 < 8; groups of the last axis (4 consecutive ranks) do not.
    odd = MeshTopology(a100, (2, 3, 4))
    assert [odd.spans_nodes(a) for a in range(3)] == [True, True, False]
    expected = collective_time("all_reduce", 1e9, 16, a100.inter_node)
    assert mesh.collective_time("all_reduce", 1e9, 0) == expected


def test_mesh_uses_scoped_overrides():
    d = load_cluster("dgx-a100-80g").to_dict()
    d["collectives"] = {"inter_node": {"all_reduce": {"alpha": 1.0, "beta": 0.0}}}
    mesh = MeshTopology(ClusterSpec.from_dict(d), (16, 8))
    assert mesh.collective_time("all_reduce", 1e6, 0) == 1.0
    assert mesh.collective_time("all_reduce", 1e6, 1) < 1e-3  # intra: formula


def test_mesh_validation():
    a100 = load_cluster("dgx-a100-80g")
    for bad in ((), (0, 8), (3, 4)):  # 12 devices: not whole nodes
        with pytest.raises((ValueError, ClusterError)):
            MeshTopology(a100, bad)
    with pytest.raises(ValueError, match="axis"):
        MeshTopology(a100, (4, 2)).axis_link(2)


def test_fit_alpha_beta_recovers_synthetic_curve():
    rng = np.random.default_rng(0)
    alpha, beta = 2e-5, 1 / 25e9
    sizes = np.logspace(3, 9, 25)
    times = (alpha + beta * sizes) * (1 + 0.01 * rng.standard_normal(sizes.size))
    a, b = fit_alpha_beta(list(sizes), list(times))
    assert b == pytest.approx(beta, rel=0.02)
    assert a == pytest.approx(alpha, rel=0.05)


def test_fit_alpha_beta_clamps_and_validates():
    a, b = fit_alpha_beta([1, 2, 3], [0.9, 2.0, 3.1])  # raw intercept < 0
    assert a == 0.0 and b > 0
    a, b = fit_alpha_beta([1, 2, 3], [2.0, 1.9, 1.8])  # raw slope < 0
    assert b == 0.0 and a == pytest.approx(1.9, rel=0.01)
    with pytest.raises(ValueError):
        fit_alpha_beta([1, 1], [1, 2])


# ---- isolation -----------------------------------------------------------------

def test_does_not_import_torch_or_autopar():
    code = ("import cost_models, sys; cost_models.load_cluster('cpu'); "
            "assert 'torch' not in sys.modules and 'autopar' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=Path(__file__).resolve().parents[1])
