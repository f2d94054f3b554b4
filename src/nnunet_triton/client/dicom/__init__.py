"""DICOM input and output: ``files`` (finding series), ``volume`` (a series as
a volume), ``seg`` (DICOM-SEG).
"""
