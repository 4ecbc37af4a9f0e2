def map_nested_tensor(f, x): return x
def key_average(r, exclude_nan=False): return {}
