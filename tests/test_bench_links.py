"""loom bench links without namespaces: the CLI knows it, and its report renders from a recorded summary."""

import pytest

from loom.cli import _build_parser
from loom_bench import links

pytestmark = pytest.mark.unit


def _summary() -> dict:
    def run(hosts: int, rate: str) -> dict:
        results = {
            name: {"seconds": 0.15, "bus_bits_per_s": 9e8 * f, "fraction_of_link": 0.9 * f}
            for name, f in (("native", 1.0), ("ring", 0.95), ("driver", 0.5))
        }
        steps = {"uncompressed": 0.6, "powersgd:4": 0.1, "topk:0.01": 0.12}
        return {"hosts": hosts, "rate": rate, "bytes": 16 << 20, "results": results, "dp_step_s": steps}

    return {
        "command": "loom bench links",
        "date": "2026-11-22 22:00 UTC",
        "load_before": 1.0,
        "load_after": 2.0,
        "seconds": 300.0,
        "reps": 5,
        "dp_reps": 3,
        "dp_steps": 5,
        "runs": [run(k, rate) for k in (2, 3) for rate in links.RATES],
    }


@pytest.mark.timeout(10)
def test_cli_wires_links():
    ns = _build_parser().parse_args(["bench", "links", "--quick", "--out", "somewhere"])
    assert (ns.which, ns.quick, str(ns.out)) == ("links", True, "somewhere")


@pytest.mark.timeout(30)
def test_report_has_every_host_count_rate_and_codec(tmp_path):
    text = links._markdown(_summary())
    assert "`loom bench links`" in text
    for hosts in (2, 3):
        for rate in links.RATES:
            assert f"| {hosts} | {rate} | powersgd:4 | 100 | 6.00 |" in text
            assert f"| {hosts} | {rate} | topk:0.01 | 120 | 5.00 |" in text
            assert f"| {hosts} | {rate} | 16 MiB | ring |" in text
    links._plot(_summary(), tmp_path / "links.png")
    assert (tmp_path / "links.png").stat().st_size > 1000
