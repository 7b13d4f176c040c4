"""trend"""
