"""Every relative link in README.md and docs/*.md points to a file that exists, and every
#anchor to a heading of its page (GitHub's anchor rule). Usage: docs_links-test.py SOURCE_DIR"""
import os
import re
import sys


def anchors(path):
    out = set()
    for line in open(path, encoding="utf-8"):
        if line.startswith("#"):
            a = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            out.add(a)
    return out


def main():
    root = sys.argv[1]
    pages = [os.path.join(root, "README.md")] + [
        os.path.join(root, "docs", f) for f in sorted(os.listdir(os.path.join(root, "docs")))
        if f.endswith(".md")]
    bad = []
    for page in pages:
        text = open(page, encoding="utf-8").read()
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(file):
                bad.append(f"{os.path.relpath(page, root)}: link to {target}: no such file")
            elif anchor and file.endswith(".md") and anchor not in anchors(file):
                bad.append(f"{os.path.relpath(page, root)}: link to {target}: no such heading")
    for b in bad:
        print(b)
    print(f"{len(pages)} pages, {len(bad)} broken link(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
