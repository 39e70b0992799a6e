"""The k policy (engine/speculative/adaptive_k.py) on synthetic costs and acceptance: k = 0 where drafting does not
pay, served round costs and the host's gap moving the choice, the temperature mix and rows that do not
speculate, and the climb back when acceptance rises again."""

from __future__ import annotations

import random

from engine.speculative.adaptive_k import AdaptiveK, Mix

# seconds per round: drafts are cheap over one row, the verify of 8 rows x (k + 1) tokens is not
COSTS = {1: {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}, 8: {0: 1.0, 1: 2.0, 2: 2.9, 3: 3.8}}


def test_k_is_zero_where_drafting_does_not_pay():
    policy = AdaptiveK(COSTS, 3, prior=0.8)
    assert policy.best(1) == 3  # (1 + .8 + .64 + .51) / 1.3 is the best
    assert policy.best(5) == 0 and policy.best(64) == 0  # bucket 8 (and above): the verify costs too much
    assert policy.table() == {1: 3, 8: 0}
    for _ in range(400):  # the draft stops being accepted at all
        policy.observe(3, [0], [])
    assert policy.rates[False][0] < 0.05 and policy.best(1) == 0
    assert policy.rates[False][1:] == [0.8, 0.8]  # positions no row reached keep their estimate


def test_served_round_costs_and_the_host_gap_move_the_choice():
    """The capture-time table is where costs start: a served round's own time replaces it, and the host's
    time between rounds (the same for every k) makes the drafts' extra tokens worth their verify."""
    policy = AdaptiveK(COSTS, 3, prior=0.8)
    for _ in range(100):  # served rounds of 3 drafts over one row cost 3x the capture's replay
        policy.observe_cost(1, 3, False, 3.9, None)
    assert abs(policy.cost[1, 3, False] - 3.9) < 0.01 and policy.best(1) == 2
    assert policy.best(8) == 0
    for _ in range(100):  # 3 s of host work between rounds of 8 rows
        policy.observe_cost(8, 0, False, 1.0, 3.0)
    assert abs(policy.host[8] - 3.0) < 0.01
    assert policy.best(8) == 3  # 8 x 2.95 tokens in 3.8 + 3 s beat 8 in 1 + 3
    # what the server prints at its start and stop: the bucket's costs in ms, its host gap, the rates
    assert policy.describe(5) == (
        "8 rows: round ms by k [0, 1, 2, 3] greedy [1000.00 2000.00 2900.00 3800.00], sampled [1000.00 "
        "2000.00 2900.00 3800.00]; host gap 2999.92 ms; acceptance by position greedy [0.80 0.80 0.80], "
        "sampled [0.80 0.80 0.80]"
    )


def test_the_temperature_mix_and_rows_that_do_not_speculate():
    """Greedy and sampled rows keep their own acceptance, the sampled round variant its own costs: a
    batch of greedy rows drafts, the same batch sampled does not, a mix sits between; rows that opted
    out add tokens at no k."""
    costs = {4: {0: 1.0, 1: 1.2, 2: 1.4, 3: 1.6}}
    sampled_costs = {4: {0: 1.1, 1: 1.5, 2: 1.9, 3: 2.3}}  # the sampled accept is an eager break
    policy = AdaptiveK(costs, 3, prior=0.5, sampled_costs=sampled_costs)
    for _ in range(300):
        policy.observe(3, [3, 3, 2], [0, 0, 1])  # greedy rows accept most drafts, sampled rows few
    assert policy.rates[False][0] > 0.99 and 0.3 < policy.rates[True][0] < 0.4
    greedy, sampled = Mix(greedy=4), Mix(sampled=4, sampled_round=True)
    assert policy.best(4, greedy) == 3 and policy.best(4, sampled) == 0
    assert policy.best(4, Mix(greedy=3, sampled=1, sampled_round=True)) == 2  # the sampled variant's costs
    assert policy.best(4, Mix(greedy=1, plain=3)) == 2  # three opted out: one row's drafts pay less
    assert policy.best(4, Mix(plain=4)) == 0 and policy.choose(4, Mix(plain=4)) == 0  # never explores for nobody
    assert policy.table() == {4: 3} and policy.table(sampled=True) == {4: 0}


def simulate(policy: AdaptiveK, accept: float, rounds: int, rng: random.Random, behind: list[bool]) -> list[int]:
    """Rounds over one row whose drafts are each accepted with probability `accept` (after a k = 0 round
    the draft is behind: its first proposal is stale and the round teaches nothing), as SpecDecoder
    feeds the policy; -> each round's k."""
    ks = []
    for _ in range(rounds):
        k = policy.choose(1)
        a = 0
        while a < k and rng.random() < (0.01 if behind[0] and a == 0 else accept):
            a += 1
        if not behind[0]:
            policy.observe(k, [a], [])
        behind[0] = k == 0
        ks.append(k)
    return ks


def test_k_climbs_back_when_acceptance_rises():
    """One client: a good stretch, a stretch where no draft is kept (k falls to 0), then good again: the
    exploration rounds (one more draft than the best, two in a row every 32) find the way back to k = 3."""
    policy, rng, behind = AdaptiveK(COSTS, 3), random.Random(0), [False]
    assert simulate(policy, 0.9, 500, rng, behind)[-100:] == [3] * 100
    bad = simulate(policy, 0.03, 1000, rng, behind)
    assert bad[-1] == 0 and sum(k == 0 for k in bad[-500:]) > 450  # k = 0, explorations aside
    good = simulate(policy, 0.9, 1000, rng, behind)
    assert good.index(3) < 300 and good[-200:] == [3] * 200
    assert min(policy.rates[False]) > 0.8


def test_a_k_not_run_lately_cannot_look_cheaper_than_the_k_that_runs():
    """Served k = 0 rounds cost 3x the capture's replay (real kv lengths, the host): the drafting rounds'
    table costs, never served, rise with them (plus the table's extra for the drafts), so a draft that is
    never kept does not win on a stale price."""
    policy = AdaptiveK(COSTS, 3, prior=0.8)
    for _ in range(400):
        policy.observe(3, [0], [])
        policy.observe_cost(1, 0, False, 3.0, None)
    assert policy.cost[1, 1, False] == 1.1  # its own estimate: the table's
    assert [round(c, 2) for c in policy.round_costs(1, False).values()] == [3.0, 3.1, 3.2, 3.3]
    assert policy.best(1) == 0 and policy.rates[False][0] < 0.05


def test_probes_from_k_0_back_off_and_come_back_when_drafts_are_kept():
    """At k = 0 a probe pays the draft's whole cost: the rounds between probes double (32, 64, 128, then
    128), so 2000 rounds where nothing pays hold about 2 x 2000 / 128 probe rounds, not 2 x 2000 / 32;
    a probe whose rows keep their drafts brings the interval back to 32, and k climbs back."""
    policy, rng, behind = AdaptiveK(COSTS, 3), random.Random(1), [False]
    simulate(policy, 0.9, 300, rng, behind)
    bad = simulate(policy, 0.0, 2000, rng, behind)
    assert bad[-1000:].count(0) == 1000 - 2 * 8 and policy._every[1] == 128
    good = simulate(policy, 0.9, 400, rng, behind)
    assert good.index(3) < 200 and good[-100:] == [3] * 100
