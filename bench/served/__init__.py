"""The whole service under Locust (``scripts/bench_serve``): the benchmark app's config, the
levels' arrivals, what each level measured and the report beside the engine alone; word
timestamps' cost; capacity per replica; the CPU profile's TTFB."""
