"""What operators watch: the stats tracker, the status report, TensorBoard summaries, Prometheus."""
