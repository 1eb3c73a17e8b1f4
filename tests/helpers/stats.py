"""Statistics the exactness tests share."""

from __future__ import annotations

from collections import Counter
import numpy as np


def _contingency_pvalue(a: list, b: list) -> float:
    from scipy.stats import chi2_contingency
    ca, cb = Counter(map(tuple, a)), Counter(map(tuple, b))
    keys = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 10]
    rare = (sum(ca[k] for k in ca if k not in keys), sum(cb[k] for k in cb if k not in keys))
    table = np.array([[ca[k] for k in keys], [cb[k] for k in keys]], dtype=float)
    if min(rare) > 0:
        table = np.column_stack([table, rare])
    return chi2_contingency(table).pvalue


