"""The engine: the one run path, communicator contexts and their work memory, selection,
the cache of bound calls and the one executor that runs any schedule."""
