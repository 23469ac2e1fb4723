"""Ranks' collectives in virtual time, against their closed forms.

Each rank is a job resident on its own device; a collective starts when its last member
reaches it and takes the algorithm's transfers over the members' links
(``proxy/vtime/collectives.py``).
"""

from __future__ import annotations

import math

import pytest
from morphling.devices.models.links import LINKS
from morphling.devices.models.profiles import BUILTIN
from morphling.proxy.vtime.collectives import Link, collective_s
from morphling.proxy.vtime.timeline import Bottleneck, Operation, Timeline
from timeline_driver import Recorder, new_timeline, profile, submit, task

MB = 1e6


def ranks(tl: Timeline, profiles: list) -> list[int]:
    """A job per profile, each resident on a device of that profile: ranks 0..n−1."""
    jobs = []
    for r, p in enumerate(profiles):
        tl.add_device(r, f"{p.name}-{r}", p)
        tl.open_job(r + 1, f"rank-{r}", device=r, rank=r)
        jobs.append(r + 1)
    return jobs


def ring_allreduce_s(n: int, nbytes: int, bw: float, lat: float) -> float:
    """The closed form: 2(n−1)/n·S/bw plus 2(n−1) latencies each way (up and down)."""
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * 2 * lat


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_a_ring_allreduce_takes_its_closed_form_from_the_last_arrival(n):
    tl, _ = new_timeline()
    jobs = ranks(tl, [profile(bw=10 * MB, lat=0.002)] * n)
    ended, nbytes = {}, 4_000_000
    op = Operation(("world", 1), "allreduce", nbytes, tuple(range(len(jobs))))
    for r, job in enumerate(jobs):  # each reaches it after its own host time
        tl.collective(job, job - 1, 7, op, after=0, host_s=0.01 * r,
                      done=lambda issue, end, r=r: ended.__setitem__(r, (issue, end)))  # fmt: skip
    assert len(ended) == n
    last = 0.01 * (n - 1)
    expected = last + ring_allreduce_s(n, nbytes, 10 * MB, 0.002)
    for r, (issue, end) in ended.items():
        assert issue == pytest.approx(0.01 * r)
        assert end == pytest.approx(expected, rel=1e-12)


def test_a_collective_waits_for_its_last_member_and_holds_blocking_ranks():
    """Rank 0 reaches the all-reduce first and waits; its next GEMM starts after it."""
    tl, _ = new_timeline()
    jobs = ranks(tl, [profile(bw=10 * MB, lat=0.001)] * 2)
    rec, ended = Recorder(), {}
    op = Operation(("world", 1), "allreduce", 1_000_000, tuple(range(len(jobs))))
    tl.collective(
        jobs[0], jobs[0] - 1, 5, op, after=0, host_s=0.0, done=lambda i, e: ended.setdefault(0, e)
    )
    assert not ended  # rank 1 has not reached it
    tl.collective(
        jobs[1], jobs[1] - 1, 5, op, after=0, host_s=0.5, done=lambda i, e: ended.setdefault(1, e)
    )
    end = 0.5 + ring_allreduce_s(2, 1_000_000, 10 * MB, 0.001)
    assert ended == {0: pytest.approx(end), 1: pytest.approx(end)}
    submit(tl, rec, jobs[0], task(9, 64, 64, 64), 64, after=5, host_s=0.25)
    issue, _ = rec.ended[9]
    assert issue == pytest.approx(end + 0.25)


def test_a_wifi_fleet_is_slower_than_a_lan_fleet_by_its_links():
    size, n = 40_000_000, 4
    times = {}
    for name in ("lan", "wifi"):
        tl, _ = new_timeline()
        p = LINKS[name].apply(BUILTIN["rpi4"])
        jobs = ranks(tl, [p] * n)
        op = Operation(("world", 1), "allreduce", size, tuple(range(len(jobs))))
        for job in jobs:
            tl.collective(job, job - 1, 1, op, after=0, host_s=0.0,
                          done=lambda i, e, n=name: times.__setitem__(n, e))  # fmt: skip
        # each round, a chunk goes up one link and down the next: at the slower one's rate
        closed = 2 * (n - 1) / n * size / min(p.ul_bw, p.dl_bw)
        closed += 2 * (n - 1) * (p.ul_lat_s + p.dl_lat_s)
        assert times[name] == pytest.approx(closed)
    assert times["wifi"] > 2 * times["lan"]


def test_an_access_point_shared_by_the_ranks_bounds_every_round():
    """Each ring round moves n chunks through the access point: n·(S/n)/bw_ap at least."""
    n, size, ap = 4, 8_000_000, 5 * MB
    tl, _ = new_timeline(bottleneck=Bottleneck(ap, ap))
    jobs = ranks(tl, [profile(bw=100 * MB, lat=0.0)] * n)
    ended = []
    op = Operation(("world", 1), "allreduce", size, tuple(range(len(jobs))))
    for job in jobs:
        tl.collective(job, job - 1, 1, op, after=0, host_s=0.0, done=lambda i, e: ended.append(e))
    assert ended == [pytest.approx(2 * (n - 1) * size / ap)] * n


def test_an_async_collective_overlaps_the_ranks_compute_and_ends_its_step():
    """DDP's buckets: the rank computes on while its all-reduce runs; its step does not end
    before the all-reduce."""
    tl, _ = new_timeline()
    jobs = ranks(tl, [profile(bw=1 * MB, lat=0.0)] * 2)
    rec, steps = Recorder(), {}
    op = Operation(("world", 1), "allreduce", 2_000_000, (0, 1), blocking=False)
    comm = ring_allreduce_s(2, 2_000_000, 1 * MB, 0.0)  # 2 s
    for job in jobs:
        tl.collective(job, job - 1, 3, op, after=0, host_s=0.0, done=lambda i, e: None)
    submit(tl, rec, jobs[0], task(4, 64, 64, 64), 64, host_s=0.1)  # not after the all-reduce
    for job in jobs:
        tl.mark_step(job, 1, host_s=0.05, done=lambda t, job=job: steps.setdefault(job, t))
    issue, end = rec.ended[4]
    assert issue == pytest.approx(0.1) and end < comm
    assert {job: t.t1 for job, t in steps.items()} == {j: pytest.approx(comm + 0.05) for j in jobs}
    assert steps[jobs[0]].comm_s == pytest.approx(comm)


def test_send_and_recv_are_one_transfer_from_source_to_destination():
    tl, _ = new_timeline()
    fast, slow = profile(bw=100 * MB, lat=0.001), profile(bw=10 * MB, lat=0.003)
    jobs = ranks(tl, [fast, slow])
    ended = {}
    for job, name in zip(jobs, ("send", "recv"), strict=True):
        op = Operation(((0, 1), 1), name, 1_000_000, (0, 1))
        tl.collective(job, job - 1, 2, op, after=0, host_s=0.0,
                      done=lambda i, e, n=name: ended.setdefault(n, e))  # fmt: skip
    one_way = 0.001 + 0.003 + 1_000_000 / (10 * MB)  # the slower end's rate
    assert ended == {"send": pytest.approx(one_way), "recv": pytest.approx(one_way)}


def test_the_rooted_and_gathering_operations_price_as_documented():
    links = [Link(0.001, 10 * MB, 0.001, 10 * MB)] * 4
    hop = 0.002 + 1_000_000 / (10 * MB)
    assert collective_s("broadcast", 1_000_000, links, root=2) == pytest.approx(3 * hop)
    assert collective_s("reduce", 1_000_000, links, root=0) == pytest.approx(3 * hop)
    assert collective_s("allgather", 1_000_000, links) == pytest.approx(3 * hop)
    assert collective_s("reduce_scatter", 4_000_000, links) == pytest.approx(3 * hop)
    assert collective_s("barrier", 0, links) == pytest.approx(6 * 0.002)
    assert collective_s("allreduce", 10**9, links[:1]) == 0.0
    assert math.isfinite(collective_s("alltoall", 1_000_000, links))
    with pytest.raises(ValueError, match="'mystery'"):
        collective_s("mystery", 1, links)


@pytest.mark.parametrize(("n", "hops"), [(2, 2), (4, 6), (7, 8)])
def test_a_tree_allreduce_reduces_up_and_broadcasts_down_a_level_at_a_time(n, hops):
    """Binary tree: a level's parent takes its children in turn, up then down. Four
    members: 3→1, then 1 and 2→0 (two in turn), and back: 6 hops; seven (full): 8."""
    hop = 0.002 + 1_000_000 / (10 * MB)
    links = [Link(0.001, 10 * MB, 0.001, 10 * MB)] * n
    seconds = collective_s("allreduce", 1_000_000, links, algorithm="tree")
    assert seconds == pytest.approx(hops * hop)


def test_a_tree_rooted_elsewhere_uses_the_roots_link_at_the_top():
    """The root's slow uplink carries its broadcast to both children, in turn."""
    fast, slow = Link(0.0, 100 * MB, 0.0, 100 * MB), Link(0.0, 1 * MB, 0.0, 100 * MB)
    links = [fast, fast, slow]
    seconds = collective_s("broadcast", 1_000_000, links, root=2, algorithm="tree")
    assert seconds == pytest.approx(2 * 1.0)


def test_a_star_sends_everything_up_to_the_server_then_down():
    """A parameter server on the host: every member's uplink at once, then every downlink;
    an access point carries each phase's bytes at its own rate."""
    n, size, lat = 4, 2_000_000, 0.003
    links = [Link(lat, 10 * MB, lat, 20 * MB)] * n
    one_way = lat + size / (10 * MB), lat + size / (20 * MB)
    assert collective_s("allreduce", size, links, algorithm="star") == pytest.approx(sum(one_way))
    gathered = collective_s("allgather", size, links, algorithm="star")
    assert gathered == pytest.approx(one_way[0] + lat + (n - 1) * size / (20 * MB))
    ap = 4 * MB
    shared = collective_s("allreduce", size, links, bottleneck_bw=ap, algorithm="star")
    assert shared == pytest.approx(2 * n * size / ap)
    with pytest.raises(ValueError, match="'mesh'"):
        collective_s("allreduce", size, links, algorithm="mesh")


def test_every_algorithm_prices_every_operation_and_a_pair_the_same():
    links = [Link(0.001, 10 * MB, 0.002, 5 * MB)] * 5
    ops = ("allreduce", "barrier", "reduce", "broadcast", "allgather", "reduce_scatter",
           "alltoall", "gather", "scatter")  # fmt: skip
    for algorithm in ("ring", "tree", "star"):
        for op in ops:
            assert collective_s(op, 1_000_000, links, root=3, algorithm=algorithm) > 0, op
        pair = collective_s("send", 1_000_000, links[:2], algorithm=algorithm)
        assert pair == pytest.approx(0.003 + 1_000_000 / (5 * MB))


def test_a_ranks_collectives_queue_on_its_links_in_the_order_it_reached_them():
    """DDP's buckets: two async all-reduces issued back to back cross the links one after
    the other, not at once."""
    tl, _ = new_timeline()
    jobs = ranks(tl, [profile(bw=1 * MB, lat=0.0)] * 2)
    ends: dict[int, float] = {}
    for bucket in (1, 2):
        op = Operation(("world", bucket), "allreduce", 1_000_000, (0, 1), blocking=False)
        for job in jobs:
            tl.collective(job, job - 1, 10 + bucket, op, after=0, host_s=0.0,
                          done=lambda i, e, b=bucket: ends.__setitem__(b, e))  # fmt: skip
    comm = ring_allreduce_s(2, 1_000_000, 1 * MB, 0.0)
    assert ends == {1: pytest.approx(comm), 2: pytest.approx(2 * comm)}


@pytest.mark.parametrize("late_first", [True, False])
def test_a_collective_of_a_shared_member_waits_for_its_earlier_one_whatever_the_message_order(
    late_first,
):
    """Rank 0 reaches A (with rank 1) and then B (with rank 2), both async. Whether rank 2's
    part of B or rank 1's late part of A comes in first, B starts when A is off rank 0's
    links."""
    tl, _ = new_timeline()
    jobs = ranks(tl, [profile(bw=1 * MB, lat=0.0)] * 3)
    a = Operation(("group", (0, 1), 1), "allreduce", 1_000_000, (0, 1), blocking=False)
    b = Operation(("group", (0, 2), 1), "allreduce", 1_000_000, (0, 2), blocking=False)
    ends: dict[str, float] = {}

    def reach(job: int, op: Operation, host_s: float) -> None:
        name = "A" if op is a else "B"
        tl.collective(job, job - 1, ord(name), op, after=0, host_s=host_s,
                      done=lambda i, e: ends.__setitem__(name, e))  # fmt: skip

    reach(jobs[0], a, 0.0)
    reach(jobs[0], b, 0.0)
    calls = [(jobs[1], a, 3.0), (jobs[2], b, 0.0)]
    for call in calls if late_first else calls[::-1]:
        reach(*call)
    comm = ring_allreduce_s(2, 1_000_000, 1 * MB, 0.0)
    assert ends == {"A": pytest.approx(3.0 + comm), "B": pytest.approx(3.0 + 2 * comm)}


def test_a_rank_waits_for_an_async_collective_where_it_uses_its_data():
    """DDP: the bucket's all-reduce runs beside the rest of the backward pass; the rank waits
    for it where it copies the bucket back (WAIT), and computes on from its end. A wait for
    one that has ended already costs nothing."""
    tl, _ = new_timeline()
    jobs = ranks(tl, [profile(bw=1 * MB, lat=0.0)] * 2)
    rec = Recorder()
    op = Operation(("world", 1), "allreduce", 2_000_000, (0, 1), blocking=False)
    comm = ring_allreduce_s(2, 2_000_000, 1 * MB, 0.0)  # 2 s
    for job in jobs:
        tl.collective(job, job - 1, 3, op, after=0, host_s=0.0, done=lambda i, e: None)
    submit(tl, rec, jobs[0], task(4, 64, 64, 64), 64, host_s=0.1)  # beside the all-reduce
    tl.wait(jobs[0], 3, 5, after=4, host_s=0.05)  # then its data is needed
    submit(tl, rec, jobs[0], task(6, 64, 64, 64), 64, after=5, host_s=0.25)
    assert rec.ended[4][0] == pytest.approx(0.1) and rec.ended[4][1] < comm
    assert rec.ended[6][0] == pytest.approx(comm + 0.25)
    tl.wait(jobs[0], 3, 7, after=6, host_s=0.0)  # over already: no time
    submit(tl, rec, jobs[0], task(8, 64, 64, 64), 64, after=7, host_s=0.5)
    assert rec.ended[8][0] == pytest.approx(rec.ended[6][1] + 0.5)


def test_a_collective_completes_after_a_member_that_reached_it_has_left():
    """Rank 1 reaches the all-reduce and its job closes (its process ended); rank 0's part
    still completes it, and only rank 0 settles."""
    tl, _ = new_timeline()
    jobs = ranks(tl, [profile(bw=1 * MB, lat=0.0)] * 2)
    ended: list[float] = []
    op = Operation(("world", 1), "allreduce", 1_000_000, (0, 1))
    tl.collective(jobs[1], 1, 2, op, after=0, host_s=0.5, done=lambda i, e: None)
    tl.close_job(jobs[1])
    tl.collective(jobs[0], 0, 2, op, after=0, host_s=0.0, done=lambda i, e: ended.append(e))
    assert ended == [pytest.approx(0.5 + ring_allreduce_s(2, 1_000_000, 1 * MB, 0.0))]


def test_ranks_that_mirror_a_rank_have_its_times_and_take_their_part_on_their_own_links():
    """Replay's classes: ranks 2 and 3 mirror rank 1 (no job of their own, on devices of
    rank 1's profile). Each round of the all-reduce through the access point moves every
    member's chunk, theirs included; the steps end as they do with a job for each rank."""
    n, size = 4, 4_000_000

    def run(mirrored: bool) -> tuple[dict[int, float], dict[int, float]]:
        tl, _ = new_timeline(bottleneck=Bottleneck(5 * MB, 5 * MB))
        slow, fast = profile("slow", bw=10 * MB, lat=0.001), profile("fast", bw=40 * MB)
        for r in range(n):
            tl.add_device(r, f"d{r}", fast if r == 0 else slow)
        jobs = (0, 1) if mirrored else range(n)
        for r in jobs:
            mirrors = {2: 2, 3: 3} if mirrored and r == 1 else None
            tl.open_job(r + 1, f"rank-{r}", device=r, rank=r, mirrors=mirrors)
        op = Operation(("world", 1), "allreduce", size, tuple(range(n)), blocking=False)
        rec, ended, steps = Recorder(), {}, {}
        for r in jobs:
            submit(tl, rec, r + 1, task(10 + r, 256, 256, 256), 256, host_s=0.1 * (r > 0))
            tl.collective(r + 1, r, 20, op, after=10 + r, host_s=0.0,
                          done=lambda i, e, r=r: ended.__setitem__(r, e))  # fmt: skip
            tl.mark_step(r + 1, 1, host_s=0.05, done=lambda t, r=r: steps.setdefault(r, t.t1))
        return ended, steps

    ended, steps = run(mirrored=False)
    assert len(set(ended.values())) == 1 and steps[2] == steps[3] == steps[1]
    assert ended[0] > 2 * (n - 1) * size / (5 * MB)  # four members' chunks a round
    got_ended, got_steps = run(mirrored=True)
    assert got_ended == {r: pytest.approx(ended[r], abs=1e-12) for r in (0, 1)}
    assert got_steps == {r: pytest.approx(steps[r], abs=1e-12) for r in (0, 1)}
