"""Model hosting: the models the daemon holds in memory (`host.ModelHost`), from the first one
loaded at start to those a request names, and how the rest of the daemon sees them
(`facade.HostBridge`, `collector.HostCollector`, `catalogue.local_catalogue`)."""
