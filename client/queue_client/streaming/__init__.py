"""A split's stream on the trainer's side: the leases of its files, reading ahead, opening and
verifying each file, rows cut to any batch size, the copy to the device, resume plans and
skipped steps."""
