"""k that follows the load: the draft tokens of each round, from the measured cost of a round at each
capture size and the running acceptance.

A round of k drafts over a bucket of B rows costs t(B, k) (measured once, after capture, by replaying
each round graph: `measure_round_costs`) and emits E(k) = 1 + r_0 + ... + r_{k-1} tokens per row,
r_i the share of rounds whose draft token i is accepted (acceptance is a prefix, so r_i falls with i).
Per row and second a round then yields E(k) / t(B, k): the policy picks the k that maximises it for
the bucket the live rows fall in. k = 0 (plain decoding) wins where drafting does not pay: a large
batch whose verify of B x (k + 1) tokens costs more than the tokens it buys.

The rates start from a prior (`prior ** (i + 1)`) and follow the rounds (an exponential average per
position, over the positions the round drafted); positions a smaller k did not draft keep their last
estimate, so the policy can go back to a larger k when acceptance rises.

    costs      {B: {k: seconds}}   per capture size and k
    choose(b)  -> k for a round over b rows (the smallest capture size >= b; the largest above all)
    observe(accepted, k)           a round's accepted drafts per live row
    table()    -> {B: k}           what it would choose now, per capture size (logged)
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


class AdaptiveK:
    def __init__(self, costs: dict[int, dict[int, float]], k_max: int, prior: float = 0.7, alpha: float = 0.02):
        if not costs or any(not per_k for per_k in costs.values()):
            raise ValueError("adaptive k needs a measured round cost per capture size and k")
        self.costs, self.k_max, self.alpha = costs, k_max, alpha
        self.rates = [prior ** (i + 1) for i in range(k_max)]
        self.sizes = sorted(costs)

    def bucket(self, b: int) -> int:
        return next((s for s in self.sizes if s >= b), self.sizes[-1])

    def expected_tokens(self, k: int) -> float:
        return 1.0 + sum(self.rates[:k])

    def choose(self, b: int) -> int:
        per_k = self.costs[self.bucket(b)]
        return max(per_k, key=lambda k: (self.expected_tokens(k) / per_k[k], -k))  # ties: the smaller k

    def observe(self, accepted: list[int], k: int) -> None:
        for a in accepted:
            for i in range(k):
                self.rates[i] += self.alpha * ((a > i) - self.rates[i])

    def table(self) -> dict[int, int]:
        return {size: self.choose(size) for size in self.sizes}


def measure_round_costs(
    run: Callable[[int, int], None], sizes: list[int], ks: list[int], device: torch.device, repeats: int = 5
) -> dict[int, dict[int, float]]:
    """{B: {k: seconds}}: the median of `repeats` timed calls of run(B, k) (one round over B rows with
    k drafts, on rows that are not live: every write goes to the dummy slot), after one untimed."""
    cuda = device.type == "cuda"
    costs: dict[int, dict[int, float]] = {}
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
