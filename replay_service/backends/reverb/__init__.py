"""The Reverb backend: server, tables, tf.data pipelines, Reverb's files."""
