"""The host's launch-sizing helpers against Triton's own (which cost microseconds a call on the host)."""

import numpy as np
import triton

from cudaformers.kernels.grid import cdiv, next_power_of_2


def test_match_triton():
    for n in range(0, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in range(0, 300):
        for b in range(1, 40):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert next_power_of_2(151936) == 262144 and cdiv(151936, 128) == 1187
    assert next_power_of_2(np.int64(100)) == 128 and cdiv(np.int64(100), 3) == 34
