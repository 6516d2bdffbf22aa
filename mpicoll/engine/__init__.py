"""Planning and execution: communicator contexts, work memory, algorithm
selection, cached plans and the one executor that runs any schedule."""
