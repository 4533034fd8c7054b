"""What a job hands on: record files, the records folder's lock, the environment a record was
measured in, and the store that loads records into a frame. Imports nothing else of experiments."""
