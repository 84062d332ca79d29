"""The test suite. Before any of its modules loads torch (this package's own init runs first):
one torch (OpenMP) thread in the test processes and every process they start (Ray's, `tandem
serve`'s). Two threads on the suite's 2-core machine made small ops 10 to 100 times slower
whenever a Ray or Serve process held the other core (each waited at OpenMP's barrier for a
thread that could not run). CPU shards already run one thread each (EngineConfig.cpu_threads).
"""

from cluster.environment import set_one_torch_thread

set_one_torch_thread()
