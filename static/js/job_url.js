// The selected job into the URL (?job=); app/tabs/jobs/tab.py JOB_URL_JS.
(j) => { const q = new URLSearchParams(location.search); if (j) q.set('job', j); else q.delete('job');
                        history.replaceState(null, '', '?' + q.toString()); return []; }
