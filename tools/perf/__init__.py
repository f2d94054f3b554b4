"""Load testing and benchmarks of the ``nnunet`` endpoint (``make perf``; see BENCHMARKS.md).

Modules (each a CLI with ``main(argv)`` where it makes sense):

- ``workloads``: the benchmark cases (the committed fixture, and a realistic model made with nnU-Net's
  default planner on synthetic CT-like volumes, random weights) and the small/medium/large volumes.
- ``input_data``: perf_analyzer ``--input-data`` JSON (IMAGE/SPACING content and shapes) from a case.
- ``analyzer``: one perf_analyzer run with every flag spelled out; CSV parsing.
- ``server_stats``: per-model statistics (Triton's ``/v2/models/stats``) diffed around a run.
- ``resources``: CPU and peak RSS of a process tree (tritonserver + Python stubs), sampled with psutil.
- ``baselines``: nnUNetPredictor in-process latency and the network-only floor (subprocesses).
- ``monolith``: the one-model baseline repository; ``monolith_step``: its model.py (nnUNetPredictor
  whole), copied into it: the benchmarks' own model, not part of the package.
- ``run``: the whole benchmark (``--quick`` for the fixture only); ``report``: Markdown, plots,
  BENCHMARKS.md.
- ``benchmarks_md``: the one writer of BENCHMARKS.md's generated blocks (``report``, ``defaults``,
  ``two_models``).
"""
