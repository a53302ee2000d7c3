"""The harness around the system, on the top floor beside ``jobs/`` and ``cluster/``: the
end-to-end demo (``demo.py``), the benchmarks' drivers, reports and plots (``bench.py``
the engine benchmark, ``context_bench.py`` by context length, ``recipe_bench.py`` recipes
against hours, ``features_bench.py`` and ``train_bench.py`` the feature and training
stages) and the baselines used only for comparison (HF ``generate``, HF prompt lookup,
vLLM engines). Code here may import every floor (``specdec``, ``pipelines``,
``serve_app``, ``cluster``); nothing in ``specdec``, ``pipelines`` or ``serve_app``
imports it."""
