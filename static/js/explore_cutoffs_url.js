// Epsilon and eta into the URL (left out at 0); app/tabs/explore/tab.py CUTOFF_URL_JS.
(eps, eta) => {
  const q = new URLSearchParams(location.search);
  [['epsilon', eps], ['eta', eta]].forEach(([k, v]) => {
    if (v !== null && v !== undefined && v !== '' && Number(v) !== 0) q.set(k, v); else q.delete(k); });
  history.replaceState(null, '', '?' + q.toString());
  return [];
}
