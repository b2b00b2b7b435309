"""ucfs: S3-compatible object storage mounted at /Volumes/<catalog>/<schema>/<volume>.

Importing the package imports nothing heavy; the set-up script runs before dependencies exist.
"""

__version__ = "0.1.0"
