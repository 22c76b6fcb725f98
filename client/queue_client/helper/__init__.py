"""fetch_process=True: the helper process that leases and copies files into shared memory, its
link to the trainer, the frames between them and the stream that reads its ring."""
