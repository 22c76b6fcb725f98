"""Production on a Ray cluster: providers as Ray Core actors, joining and probing the cluster,
and waiting on actors from the event loop."""
