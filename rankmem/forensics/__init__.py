"""forensics"""
