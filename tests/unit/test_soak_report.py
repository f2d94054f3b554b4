"""The soak's memory bound (tools/soak.py ``build_report``) on made-up samples: no server."""

from __future__ import annotations

import argparse

import pytest

from tools import soak


def _report(total_rss_mib: list[int], *, threshold: float, shm_mib: int = 64) -> dict:
    mib = 1 << 20
    samples = [soak.Sample(t_s=3.0 * i, server_rss=rss * mib // 2, stub_rss={"fold_0": rss * mib // 2},
                           shm_bytes=shm_mib * mib, devshm_used_bytes=0)
               for i, rss in enumerate(total_rss_mib)]
    args = argparse.Namespace(concurrency=2, warmup=6.0, growth_threshold=threshold)
    return soak.build_report(args, soak.Tally(), samples, elapsed_s=3.0 * len(samples))


@pytest.mark.parametrize(("last_three", "over"), [((1090, 1100, 1110), []),
                                                  ((1100, 1110, 1120), ["total_rss"])])
def test_total_rss_growth_over_the_bound_after_warmup_is_reported(last_three, over) -> None:
    # warmup samples (t < 6 s) are left out: their 500 MiB do not count as growth
    report = _report([500, 500, 1000, 1000, 1000, 1050, *last_three], threshold=0.10)
    assert report["samples_after_warmup"] == 7
    assert report["growth_after_warmup"]["shm_bytes"] == 0.0
    assert report["growth_over_threshold"] == over
