"""Human units in every report (issue 18: '0.001103 GiB', '6.104e-05 GiB', 'params sharded 0 of 23' under ZeRO)."""
import re

import pytest

import autopar
from autopar import units


@pytest.mark.parametrize("fn,value,text", [
    (units.seconds, 0.01468, "14.7 ms"), (units.seconds, 2e-6, "2 µs"), (units.seconds, 95, "95 s"),
    (units.seconds, 3 * 3600, "3 h"), (units.seconds, 0, "0 s"),
    (units.nbytes, 1745000, "1.66 MiB"), (units.nbytes, 64 * 1024, "64 KiB"), (units.nbytes, 80 * 2 ** 30, "80 GiB"),
    (units.nbytes, 12, "12 B"), (units.flops_rate, 1.447e9, "1.45 GFLOP/s"), (units.flops_rate, 163e12, "163 TFLOP/s"),
    (units.count, 117504, "118 k"), (units.count, 175e9, "175 G"),
])
def test_units(fn, value, text):
    assert fn(value) == text


def test_plan_summary_reads_like_a_person_wrote_it():
    p = autopar.plan("gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128", cluster="cpu", devices=4, global_batch=8,
                     strategy="dp=4,zero=3")
    text = p.summary()
    assert not re.search(r"\de[-+]\d", text), text          # no exponents
    assert not re.search(r"0\.0\d+ GiB", text), text        # no thousandths of a GiB
    flat = " ".join(re.sub("[│┌┐└┘├┤─┬┴┼]", " ", text).split())     # the table wraps long cells
    assert "by tp; ZeRO-3 shards the weights, gradients and optimizer state over dp=4" in flat
