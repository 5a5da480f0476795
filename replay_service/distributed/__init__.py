"""What runs distributed: sharded buffers and Ray actors."""
