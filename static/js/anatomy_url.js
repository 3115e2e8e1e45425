// Anatomy's controls into the URL (a default value left out); app/tabs/anatomy/link.py URL_JS.
(...v) => {
  const keys = __KEYS__, defaults = __DEFAULTS__;
  const norm = (x) => { if (Array.isArray(x)) x = x.join(','); if (typeof x === 'boolean') x = x ? 1 : 0;
                        return x === null || x === undefined ? '' : String(x); };
  const q = new URLSearchParams(location.search);
  keys.forEach((k, i) => { const x = norm(v[i]);
    if (x !== '' && x !== norm(defaults[i])) q.set(k, x); else q.delete(k); });
  history.replaceState(null, '', '?' + q.toString());
  return [];
}
