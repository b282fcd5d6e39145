"""The harness: train small models on the synthetic tasks (eval/tasks) and measure them.

``run`` (a sweep: config, cells, results.jsonl), ``train`` (one cell), ``model`` (the transformer
built from zoo parts), ``config`` (YAML with command-line overrides, also the benchmark's loader),
``distributed`` (one process or torchrun), ``report`` (tables and plots from results.jsonl) and
``attention_map`` (one head's weights in a trained checkpoint).
"""
