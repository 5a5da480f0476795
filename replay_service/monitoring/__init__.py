"""What operators watch: stats, status, TensorBoard summaries, Prometheus."""
