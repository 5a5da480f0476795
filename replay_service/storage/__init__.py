"""What is on disk: the checkpoint store and the export format."""
