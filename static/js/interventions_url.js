// The Interventions tab's prompts and choices into the URL; app/tabs/interventions/tab.py IV_URL_JS.
(...v) => {
  const keys = __KEYS__;
  const q = new URLSearchParams(location.search);
  keys.forEach((k, i) => { let x = v[i];
    if (Array.isArray(x)) x = x.join(','); if (typeof x === 'boolean') x = x ? 1 : 0;
    if (x !== null && x !== undefined && x !== '') q.set(k, x); else q.delete(k); });
  history.replaceState(null, '', '?' + q.toString());
  return [];
}
