"""Memory: `SharedList`/`SharedDict` and their record layouts, worker memory sampling, and
advice about what every worker would copy (copy-on-read, /dev/shm, descriptors).
"""
