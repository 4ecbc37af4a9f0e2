def unwrap(m): return m
