"""What-if on real history: replay the cluster's own finished jobs under a changed config.

The jobs of a period (their submit times, sizes, GPU types, tenants, users, names, priorities,
and how long their final attempt really ran) become the simulator's trace; the cluster's current
nodes, tenants, quotas and pools become its cluster. The replay goes through the production
``plan`` (scheduler.simulator.engine.replay), and its figures are set next to the same figures
computed from what really happened, read from the Job and JobAttempt rows.

In four parts, each importing only the ones before it:

- ``params``: the request (period, policy, weights, quotas, power budgets), parsed from command
  line or form strings and checked against the database;
- ``history``: the period's finished jobs as a trace and what really happened to them, and the
  current cluster, read from the database;
- ``replay``: the changed cluster, and the simulator's runs of the history on it;
- ``report``: the structured summary stored in WhatIfRun.summary, and what is shown from it
  (the tables the web page renders with templates, and the same as Markdown for the command
  line and the download).

Definitions, so that the rows compare:

- A job's run time is its final attempt's started_at..finished_at (the successful attempt for a
  job that SUCCEEDED; the one that failed for a FAILED job, which held its GPUs all the same).
  Cancelled jobs, and jobs that never started, are left out (the notes count them): when a user
  would have cancelled is not something a replay can know.
- What really happened: JCT = the final attempt's finished_at - submitted_at; the time a job held
  GPUs is the sum over its attempts of created_at (admission: the allocation is made then) to
  finished_at; queue = JCT - held, as in scheduler.simulator.metrics. So container start-up time
  counts as held in the real row and is not simulated (the replay's run time starts at its
  container's start): the real JCT is longer by that much.
- Real preemptions are the attempts stopped by preemption or a drain; their GPU-hours (lost
  unless the job checkpoints) stand where the simulator puts its restart cost.
- Real energy is what the GPUs' NVML counters booked to the attempts, busy GPUs only; the
  simulator's counts every GPU, idle ones at idle draw. Real peak power and time over budget are
  not known for past periods (telemetry is kept for a day) and show as "-".
- Every current node is taken as schedulable with every GPU healthy: a what-if asks what the
  cluster could do, not what it can do while a node is cordoned today.
- Predictions start from an empty history (the simulator learns from the replayed jobs only).

The rows: what really happened; the simulated current config (production's policy, current
quotas, weights and budgets), which says how far the simulator is from reality; and the what-if.
Finish-time fairness rho is against FIFO on static partitions of the current quotas for all rows.
"""
