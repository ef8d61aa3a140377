"""The built-in demo: a small CNN on scikit-learn's bundled handwritten digits, trained with DataParallel."""
