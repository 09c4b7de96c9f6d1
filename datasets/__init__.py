"""Datasets of the paper's experiments: synthetic bitstreams and IRMAS MFCC features (to come)."""
