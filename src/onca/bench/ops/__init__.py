"""One benchmark declaration per op: ``onca/bench/ops/<op>.py`` defines ``BENCHMARK``."""
