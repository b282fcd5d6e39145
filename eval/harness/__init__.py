"""The harness: train small models on the synthetic tasks (eval/tasks) and measure them.

``run`` (a sweep: config, cells, results.jsonl), ``train`` (one cell), ``model`` (the transformer
built from zoo parts), ``config`` (YAML with command-line overrides, also the benchmark's loader),
``distributed`` (one process or torchrun), ``report`` (tables and plots from results.jsonl) and
``attention_map`` (one head's weights in a trained checkpoint). What a cell learned, against what
its pattern can reach: ``reach`` (a pattern's reach through the model's depth), ``needs`` (the
positions each task's answers need), ``slices`` (accuracy and reach per slice), ``verdict``
(learned / cannot / not learned) and ``learned`` (the verdict of a record of any age).
"""
