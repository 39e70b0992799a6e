"""k that follows the load: each round's draft tokens from what a round costs and what it yields.

A round of k drafts over a bucket of B rows (the smallest capture size >= the live rows) takes
t(B, k, v) + h(B) seconds, v the round's variant (sampled when a row samples: its accept differs), h
the host's time between rounds. Row j emits 1 + R_j(k) tokens, R(k) = r_0 + ... + r_{k-1}, r_i =
c_0 c_1 ... c_i with c_i the rate at which draft i is accepted once 0..i-1 were, kept apart for greedy
and sampled rows; a row that does not speculate (its request opted out) emits 1 whatever k. Each round
takes the k with the most tokens per second over its rows, so k = 0 (plain decoding) wherever drafting
does not pay at this batch size and temperature mix.

Costs: t starts from the capture-time table (`measure_round_costs`: replays over dead rows, the greedy
and sampled variants) and follows each served round's own time (launch to tokens on the host, at real
kv lengths), h follows the gap since the previous round; both are exponential averages. A round of k
drafts costs at least a served round of j < k plus the table's t(k) - t(j) (it does that work and
more), so a k the server has not run lately cannot look cheaper than the k it runs.
Acceptance: c_i follows the rows that reached draft i (an exponential average from `prior`, weight
`alpha` a row). Recovery: every `explore_every` rounds of a bucket, `explore_rounds` rounds draft one
more token than the best k, so a position the policy stopped drafting is measured again and k climbs
back when it pays; while the best k stays 0 the interval doubles, up to `explore_max` (a probe from 0
pays the draft's whole fixed cost), and falls back to `explore_every` once drafting pays or a round
sees most of its rows keep a draft. Rows whose draft missed the last round (k = 0 rounds do not
advance it: its first proposal is stale) and rows that do not speculate teach nothing about acceptance.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch

Costs = dict[int, dict[int, float]]  # {B: {k: seconds}}: one round variant's cost per capture size and k


@dataclass(frozen=True)
class Mix:
    """A round's live rows by what a draft buys them."""

    greedy: int = 0  # greedy rows that speculate
    sampled: int = 0  # sampled rows that speculate
    plain: int = 0  # rows that do not speculate: one token a round whatever k
    sampled_round: bool = False  # some row samples: the round's sampled variant runs

    @property
    def rows(self) -> int:
        return self.greedy + self.sampled + self.plain


class AdaptiveK:
    def __init__(
        self,
        costs: Costs,
        k_max: int,
        prior: float = 0.7,
        alpha: float = 0.02,
        sampled_costs: Optional[Costs] = None,  # the sampled variant's (None: the greedy costs)
        beta: float = 0.1,  # weight of a served round's time in its cost estimate
        explore_every: int = 32,
        explore_rounds: int = 2,
        explore_max: int = 128,  # the longest interval between probes while k = 0
    ):
        if not costs or any(not per_k for per_k in costs.values()):
            raise ValueError("adaptive k needs a measured round cost per capture size and k")
        self.k_max, self.alpha, self.beta = k_max, alpha, beta
        self.explore_every, self.explore_rounds, self.explore_max = explore_every, explore_rounds, explore_max
        self.sizes = sorted(costs)
        self._ks = {b: sorted(per_k) for b, per_k in costs.items()}
        sampled_costs = sampled_costs or costs
        self.cost = {(b, k, s): c[b][k] for s, c in ((False, costs), (True, sampled_costs)) for b in c for k in c[b]}
        self.table_cost = dict(self.cost)  # the capture-time table: what a k costs more than a smaller one
        self.host = dict.fromkeys(self.sizes, 0.0)  # h(B)
        self.rates = {False: [prior] * k_max, True: [prior] * k_max}  # c_i per kind (sampled?)
        self.rounds: Counter = Counter()  # rounds chosen per bucket since its last probe (the exploration clock)
        self._explore_left = dict.fromkeys(self.sizes, 0)
        self._every = dict.fromkeys(self.sizes, explore_every)  # rounds between probes, per bucket

    def bucket(self, b: int) -> int:
        return next((s for s in self.sizes if s >= b), self.sizes[-1])

    def ks(self, b: int) -> list[int]:
        return self._ks[self.bucket(b)]

    def expected_drafts(self, sampled: bool) -> list[float]:
        """[R(0), ..., R(k_max)]: the draft tokens a speculating row keeps per round of k drafts."""
        out, reach = [0.0], 1.0
        for c in self.rates[sampled]:
            reach *= c
            out.append(out[-1] + reach)
        return out

    def best(self, b: int, mix: Optional[Mix] = None) -> int:
        """The k with the most tokens per second for a round over b rows (None: b greedy rows); ties: the smaller."""
        mix, bucket = mix or Mix(greedy=b), self.bucket(b)
        greedy, sampled, host = self.expected_drafts(False), self.expected_drafts(True), self.host[bucket]
        cost = self.round_costs(bucket, mix.sampled_round)

        def tokens_per_s(k: int) -> float:
            tokens = mix.rows + mix.greedy * greedy[k] + mix.sampled * sampled[k]
            return tokens / (cost[k] + host)

        return max(self.ks(b), key=lambda k: (tokens_per_s(k), -k))

    def round_costs(self, bucket: int, sampled_round: bool) -> dict[int, float]:
        """{k: seconds} a round is expected to cost: its own estimate, or more where a smaller k's served
        cost plus the table's difference says so."""
        own = {k: self.cost[bucket, k, sampled_round] for k in self._ks[bucket]}
        table = {k: self.table_cost[bucket, k, sampled_round] for k in own}
        return {k: max(own[j] + table[k] - table[j] for j in own if j <= k) for k in own}

    def choose(self, b: int, mix: Optional[Mix] = None) -> int:
        """The round's k: the best, or in an exploration run the next larger one."""
        mix, bucket, ks = mix or Mix(greedy=b), self.bucket(b), self.ks(b)
        k = self.best(b, mix)
        self.rounds[bucket] += 1
        if self.rounds[bucket] >= self._every[bucket]:  # a probe; after one from k = 0, wait twice as long
            self.rounds[bucket] = 0
            self._explore_left[bucket] = self.explore_rounds
            self._every[bucket] = min(2 * self._every[bucket], self.explore_max) if k == 0 else self.explore_every
        elif k > 0:
            self._every[bucket] = self.explore_every
        if self._explore_left[bucket] and mix.greedy + mix.sampled and k < ks[-1]:
            self._explore_left[bucket] -= 1
            return ks[ks.index(k) + 1]
        return k

    def observe(self, k: int, greedy: list[int], sampled: list[int]) -> None:
        """A round of k drafts: the draft tokens accepted by each speculating row whose draft was current.
        Position i's rows (those that reached it) count as that many steps of the average, at their mean."""
        rows = greedy + sampled
        if k and rows and 2 * sum(a > 0 for a in rows) >= len(rows):  # most rows kept a draft: probe often again
            self._every = dict.fromkeys(self.sizes, self.explore_every)
        for kind, accepted in ((False, greedy), (True, sampled)):
            rates, stopped, reach = self.rates[kind], [0] * (k + 1), len(accepted)
            for a in accepted:
                stopped[a] += 1  # rows whose first rejection is at a (k: none)
            for i in range(k):
                if not reach:
                    break
                kept = reach - stopped[i]  # rows that reached i and kept it
                rates[i] += (1 - (1 - self.alpha) ** reach) * (kept / reach - rates[i])
                reach = kept

    def observe_cost(self, b: int, k: int, sampled_round: bool, round_s: float, host_s: Optional[float]) -> None:
        """A served round's time (launch to tokens on the host) and the host's gap before it (None: the
        first round after a prefill)."""
        bucket = self.bucket(b)
        key = (bucket, k, sampled_round)
        self.cost[key] += self.beta * (round_s - self.cost[key])
        if host_s is not None:
            self.host[bucket] += self.beta * (host_s - self.host[bucket])

    def describe(self, b: int) -> str:
        """What the policy holds for b rows now: each k's round cost, greedy / sampled, and the host's gap."""
        bucket = self.bucket(b)
        ms = {s: " ".join(f"{1e3 * c:.2f}" for c in self.round_costs(bucket, s).values()) for s in (False, True)}
        rates = {s: " ".join(f"{c:.2f}" for c in self.rates[s]) for s in (False, True)}
        return (
            f"{bucket} rows: round ms by k {self.ks(b)} greedy [{ms[False]}], sampled [{ms[True]}]; "
            f"host gap {1e3 * self.host[bucket]:.2f} ms; acceptance by position greedy [{rates[False]}], "
            f"sampled [{rates[True]}]"
        )

    def table(self, sampled: bool = False) -> dict[int, int]:
        """What it would choose now per capture size, for rows that all speculate and are all greedy
        (or all sampled)."""
        return {
            size: self.best(size, Mix(sampled=size, sampled_round=True) if sampled else Mix(greedy=size))
            for size in self.sizes
        }


def measure_round_costs(
    run: Callable[[int, int], None], sizes: list[int], ks: list[int], device: torch.device, repeats: int = 5
) -> Costs:
    """{B: {k: seconds}}: the median of `repeats` timed calls of run(B, k) (one round over B rows with
    k drafts, on rows that are not live: every write goes to the dummy slot), after one untimed."""
    cuda = device.type == "cuda"
    costs: Costs = {}
    for size in sizes:
        costs[size] = {}
        for k in ks:
            run(size, k)  # warm-up
            times = []
            for _ in range(repeats):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    run(size, k)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                else:
                    t0 = time.perf_counter()
                    run(size, k)
                    times.append(time.perf_counter() - t0)
            costs[size][k] = statistics.median(times)
    return costs
