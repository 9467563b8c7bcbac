"""How the rerun state machine compares a result with its rerun: the relative difference, and the statistics of
the differences that report_stats mode collects."""

import math


def relative_difference(first, second):
    """|2(a - b) / (a + b)|; 0 for equal values (NaN equals NaN here: the same result reproduced), inf when only
    one of them is NaN or they have opposite signs summing to zero."""
    a, b = float(first), float(second)
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if math.isnan(a) or math.isnan(b) or a + b == 0.0 or math.isinf(a + b):
        return math.inf
    return abs(2.0 * (a - b) / (a + b))


class DifferenceStats:
    """Relative differences between the two runs of one validated result (report_stats mode)."""

    def __init__(self):
        self.count, self.nonzero, self.total, self.largest = 0, 0, 0.0, 0.0

    def record(self, difference):
        self.count += 1
        self.nonzero += int(difference > 0.0)
        self.total += difference
        self.largest = max(self.largest, difference)

    def summary(self):
        mean = self.total / self.count if self.count else 0.0
        return f"{self.count} reruns, {self.nonzero} differed, mean {mean:.3e}, max {self.largest:.3e}"
